"""How often a demo checkpoint copies a city it has never seen into a get_weather call: greedy replies
to ten phrasings of its own naming validation cities (real names in neither the corpus's places nor
the held-out set of tests/server/test_demo_model.py; or, with --made-up, fresh made-up names of the
corpus's kind), parsed as the server parses them. It first checks that the model's training corpus
(regenerated from its training.json) holds neither those cities nor those phrasings.

    python scripts/demo/eval_copy.py [--model dsv4/demo_model] [--made-up]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.corpus import TOOLS, made_up_city, phrasings_in, trained_text
from demo.places import MORE_PLACES, TRAIN_CITIES

from dsv4.chat import EOS, ChatParseError, encode_messages, parse_completion
from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.protocol import GenerationRequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
VALIDATION_CITIES = [
    "Turin", "Genoa", "Malaga", "Nantes", "Lille", "Klagenfurt", "Linz", "Basel", "Aarhus", "Malmo", "Tampere", "Tartu",
    "Kaunas", "Brno", "Varna", "Izmir", "Ankara", "Haifa", "Amman", "Muscat", "Kuwait City", "Pune", "Vadodara",
    "Surat", "Daegu", "Fukuoka", "Darwin", "Cairns", "Dunedin", "Winnipeg", "Halifax", "Regina", "Tucson",
    "Omaha", "Memphis", "Orlando", "Tampa", "Cusco", "Medellin", "Cali", "Rosario", "Cordoba", "Recife",
    "Salvador", "Fortaleza", "Belem", "Durban", "Kigali", "Dakar", "San Jose",
]
# Phrasings in neither the corpus nor the acceptance test, with words of their own ("pull up", "coat",
# "heatwave"): a shift like the held-out set's, so that choosing among trained seeds by this score
# chooses by the skill the test asks for without looking at the test.
PHRASINGS = ["Do you happen to know the weather in {city}?", "Can you pull up the weather for {city}?",
             "I'd love to hear about the weather in {city}.", "Is it pouring in {city}?",
             "Give me an update on the weather in {city}.", "How are things weather-wise in {city}?",
             "Would I need a coat in {city}?", "Is there a heatwave in {city}?",
             "What sort of weather are they having in {city}?", "Brief me on the weather in {city}, thanks."]


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


def check_unseen(model: Path) -> None:
    """Neither the validation cities nor the phrasings (with any name) are in the model's training corpus."""
    assert not set(VALIDATION_CITIES) & set(TRAIN_CITIES + MORE_PLACES)
    corpus = trained_text(json.loads((model / "training.json").read_text()))
    assert not [city for city in VALIDATION_CITIES if re.search(rf"\b{re.escape(city)}\b", corpus)]
    assert not phrasings_in(corpus, PHRASINGS), phrasings_in(corpus, PHRASINGS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "dsv4" / "demo_model")
    parser.add_argument("--made-up", action="store_true", help="made-up names (seed 123: not the corpus's)")
    args = parser.parse_args()
    check_unseen(args.model)
    rng = random.Random(123)
    cities = [made_up_city(rng) for _ in range(50)] if args.made_up else VALIDATION_CITIES
    hits, misses = asyncio.run(evaluate(args.model, cities))
    print(f"{hits}/{len(cities)} unseen {'made-up' if args.made_up else 'real'} cities copied into get_weather")
    for miss in misses[:10]:
        print("  miss", miss)


if __name__ == "__main__":
    main()
