"""The trained demo model (dsv4/demo_model/) served by `python -m dsv4 serve`, with the real `openai` client:
it calls get_weather for cities and phrasings held out from its training corpus, answers from the
tool result, and streams reasoning before content in thinking mode. And, on the reference model, the
indexer's selection matters at the demo's long contexts (so --verify-indexer guards something real)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from live_server import REPO, LiveServer, live_servers

import dsv4.reference.indexer
from dsv4.chat import encode_messages
from dsv4.reference import load_reference_model
from dsv4.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)

DEMO_MODEL = REPO / "dsv4" / "demo_model"
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}

# Held out from training: none of these cities or phrasings is in scripts/demo/corpus.py, and the
# test below checks that no city occurs anywhere in the generated corpus and that no user turn there
# is one of the phrasings (made-up names can hit a real one: "Baku" and "Nashville" did, and were replaced).
HELD_OUT_CITIES = [
    "Bergen", "Lyon", "Marseille", "Bern", "Antwerp", "Bordeaux", "Florence", "Venice", "Valencia", "Bilbao",
    "Cologne", "Dresden", "Leipzig", "Gdansk", "Bratislava", "Ljubljana", "Sarajevo", "Skopje", "Tirana", "Minsk",
    "Odessa", "Tbilisi", "Yerevan", "Belfast", "Almaty", "Tashkent", "Kabul", "Lahore", "Colombo", "Kathmandu",
    "Yangon", "Phnom Penh", "Taipei", "Busan", "Sapporo", "Nagoya", "Brisbane", "Adelaide", "Hobart",
    "Christchurch", "Ottawa", "Calgary", "Quebec", "Dallas", "Portland", "Knoxville", "Detroit", "Montevideo",
    "La Paz", "Asuncion",
]
HELD_OUT_PHRASINGS = [
    "Could you tell me what the weather is like in {city}?", "I'm curious about the weather in {city}.",
    "How's the weather over in {city}?", "Please look up the current weather in {city}.",
    "What kind of weather does {city} have right now?", "Any idea what the weather is in {city}?",
    "Is it cold in {city} at the moment?", "Find out the weather in {city} for me.",
    "Weather report for {city}, please.", "Should I bring a jacket in {city}?",
]
HELD_OUT = [(HELD_OUT_PHRASINGS[i % 10].format(city=city), city) for i, city in enumerate(HELD_OUT_CITIES)]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("demo")
    with live_servers(LiveServer(DEMO_MODEL, logs / "demo.log", "--max-running-requests", "16")) as (server,):
        yield openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", timeout=120, max_retries=0)


def weather_call(client: openai.OpenAI, question: str):
    """The reply message, or the server's error text when the model's output was not a valid reply (a miss)."""
    try:
        response = client.chat.completions.create(model="demo_model", messages=[{"role": "user", "content": question}],
                                                  tools=[GET_WEATHER], temperature=0, max_tokens=64)
    except openai.InternalServerError as e:
        return str(e)
    return response.choices[0].message


def test_held_out_set_is_not_in_the_corpus():
    sys.path.insert(0, str(REPO / "scripts"))
    from demo.corpus import phrasings_in, trained_text
    from demo.places import MORE_PLACES, TRAIN_CITIES

    corpus = trained_text(json.loads((DEMO_MODEL / "training.json").read_text()))
    places = set(TRAIN_CITIES + MORE_PLACES)
    assert not [city for city in HELD_OUT_CITIES if city in corpus or city in places]
    assert not phrasings_in(corpus, HELD_OUT_PHRASINGS)  # with any name in the city's place


def test_weather_tool_call_for_held_out_cities(demo_server):
    with ThreadPoolExecutor(8) as pool:
        messages = list(pool.map(lambda case: weather_call(demo_server, case[0]), HELD_OUT))
    hits = []
    for (_, city), message in zip(HELD_OUT, messages, strict=True):
        calls = [] if isinstance(message, str) else message.tool_calls or []
        arguments = [json.loads(call.function.arguments) for call in calls if call.function.name == "get_weather"]
        hits.append(any(args.get("city") == city for args in arguments))
    misses = [(question, message) for (question, _), message, hit in zip(HELD_OUT, messages, hits, strict=True)
              if not hit]
    assert sum(hits) >= 45, f"{sum(hits)}/50 held-out requests called get_weather with the city; misses: {misses[:5]}"


def test_answer_uses_the_tool_result(demo_server):
    used = 0
    for i, city in enumerate(HELD_OUT_CITIES[:10]):
        result = {"city": city, "temp_c": 3 + 3 * i, "sky": ["foggy", "sunny"][i % 2]}
        arguments = json.dumps({"city": city})
        messages = [{"role": "user", "content": HELD_OUT_PHRASINGS[i].format(city=city)},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(result)}]
        try:
            response = demo_server.chat.completions.create(model="demo_model", messages=messages,
                                                           tools=[GET_WEATHER], temperature=0, max_tokens=48)
        except openai.InternalServerError:  # the model's output was not a valid reply
            continue
        text = response.choices[0].message.content or ""
        used += f"{result['temp_c']}°C" in text and result["sky"] in text
    assert used >= 9, f"only {used}/10 answers quote the tool's temperature and sky"


def test_thinking_mode_streams_reasoning_then_content(demo_server):
    stream = demo_server.chat.completions.create(
        model="demo_model", messages=[{"role": "user", "content": "What is 7 plus 5?"}], temperature=0, max_tokens=64,
        stream=True, extra_body={"chat_template_kwargs": {"thinking": True}})
    kinds = []
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and getattr(delta, "reasoning_content", None):
            kinds.append("reasoning")
        if delta is not None and delta.content:
            kinds.append("content")
    assert "reasoning" in kinds and "content" in kinds, kinds
    assert kinds.index("content") > max(i for i, kind in enumerate(kinds) if kind == "reasoning"), kinds


def long_session_prompt() -> list[int]:
    """A session past the sliding window: a home city, several tool rounds, then a question about home."""
    messages = [{"role": "user", "content": "Hi, I am Maya and I live in Bergen."},
                {"role": "assistant", "content": "Nice to meet you, Maya! Bergen sounds lovely."}]
    for i, city in enumerate(["Lyon", "Bern", "Taipei", "Dallas"]):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}",
                      "content": json.dumps({"city": city, "temp_c": 10 + i, "sky": "cloudy"})},
                     {"role": "assistant", "content": f"It is {10 + i}°C and cloudy in {city}."}]
    messages.append({"role": "user", "content": "What is the weather where I live?"})
    text = encode_messages(messages, tools=[GET_WEATHER])
    return Tokenizer.from_dir(DEMO_MODEL).inner.encode(text, add_special_tokens=False).ids


def test_breaking_the_indexer_selection_changes_outputs(monkeypatch):
    model = load_reference_model(DEMO_MODEL)
    prompt = long_session_prompt()
    rows, topk = len(prompt) // 4, model.cfg.index_topk
    assert rows > 2 * topk, f"the long session has {rows} CSA rows, not enough for the selection to matter"
    ids = torch.tensor([prompt])
    good = model(ids)[0]
    select = dsv4.reference.indexer.indexer_topk
    # The worst rows: the top-k of the negated scores (same visibility, same count).
    monkeypatch.setattr(dsv4.reference.indexer, "indexer_topk",
                        lambda q, weights, keys, positions, ratio, k: select(q, -weights, keys, positions, ratio, k))
    bad = model(ids)[0]
    late = slice(4 * topk + 3, None)  # queries that see more rows than they may pick
    changed = (good[late].argmax(-1) != bad[late].argmax(-1)).float().mean().item()
    assert changed > 0.02, f"worst-row selection changed only {changed:.1%} of the greedy next tokens"
