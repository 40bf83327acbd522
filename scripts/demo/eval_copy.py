"""How often a demo checkpoint copies a city it has never seen into a get_weather call: greedy replies
to prompts naming validation cities (real names in neither the corpus's places nor the held-out
set of tests/server/test_demo_model.py; or, with --made-up, fresh made-up names of the corpus's
kind), parsed as the server parses them.

    python scripts/demo/eval_copy.py [--model dsv4/demo_model] [--made-up]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.corpus import TOOLS, made_up_city
from demo.places import MORE_PLACES, TRAIN_CITIES

from dsv4.chat import EOS, ChatParseError, encode_messages, parse_completion
from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.protocol import GenerationRequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
VALIDATION_CITIES = [
    "Turin", "Genoa", "Malaga", "Nantes", "Lille", "Graz", "Linz", "Basel", "Aarhus", "Malmo", "Tampere", "Tartu",
    "Kaunas", "Brno", "Varna", "Izmir", "Ankara", "Haifa", "Amman", "Muscat", "Kuwait City", "Pune", "Jaipur",
    "Surat", "Daegu", "Fukuoka", "Darwin", "Cairns", "Dunedin", "Winnipeg", "Halifax", "Regina", "Tucson",
    "Omaha", "Memphis", "Orlando", "Tampa", "Cusco", "Medellin", "Cali", "Rosario", "Cordoba", "Recife",
    "Salvador", "Fortaleza", "Belem", "Durban", "Kigali", "Dakar", "San Jose",
]
PHRASINGS = ["Please tell me the weather in {city}.", "What's it like outside in {city} today?",
             "Weather for {city}?", "I want to know the weather in {city}.", "How hot is it in {city}?"]


async def evaluate(model: Path, cities: list[str]) -> tuple[int, list[str]]:
    engine = Engine.from_args(ServerArgs(model=str(model), max_running_requests=50, disable_compile=True))
    tools = [TOOLS["get_weather"]]

    async def ask(i: int, city: str) -> tuple[str, str]:
        prompt = encode_messages([{"role": "user", "content": PHRASINGS[i % len(PHRASINGS)].format(city=city)}],
                                 tools=tools)
        request = GenerationRequest(rid=f"eval-{i}", input_ids=tuple(engine.tokenizer.encode(prompt)),
                                    sampling=SamplingParams(max_new_tokens=64, temperature=0.0))
        outputs = [out async for out in engine.submit(request)]
        # The server's parse sees the end of sentence where generation stopped at it.
        return city, "".join(out.text for out in outputs) + (EOS if outputs[-1].finish_reason == "stop" else "")

    await engine.start()
    try:
        replies = await asyncio.gather(*(ask(i, city) for i, city in enumerate(cities)))
    finally:
        await engine.stop()
    hits, misses = 0, []
    for city, text in replies:
        try:
            calls = parse_completion(text, tools=tools)["tool_calls"]
        except ChatParseError:
            calls = []
        if any(call["name"] == "get_weather" and call["arguments"].get("city") == city for call in calls):
            hits += 1
        else:
            misses.append(f"{city}: {text[:120]!r}")
    return hits, misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "dsv4" / "demo_model")
    parser.add_argument("--made-up", action="store_true", help="made-up names (seed 123: not the corpus's)")
    args = parser.parse_args()
    assert not set(VALIDATION_CITIES) & set(TRAIN_CITIES + MORE_PLACES)
    rng = random.Random(123)
    cities = [made_up_city(rng) for _ in range(50)] if args.made_up else VALIDATION_CITIES
    hits, misses = asyncio.run(evaluate(args.model, cities))
    print(f"{hits}/{len(cities)} unseen {'made-up' if args.made_up else 'real'} cities copied into get_weather")
    for miss in misses[:10]:
        print("  miss", miss)


if __name__ == "__main__":
    main()
