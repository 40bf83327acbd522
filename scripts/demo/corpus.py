"""The demo model's training corpus, generated from a seed in the official DeepSeek-V4 chat encoding.

Every sample is one conversation rendered by `dsv4.chat.encode_messages`: small talk, arithmetic,
repeating made-up names back, tool use (weather by city, time by timezone, calculator, unit conversion, search) whose arguments
are copied from the user's words, tool results answered in text that uses them, thinking and chat
mode, and multi-turn sessions that grow past the 128-token sliding window (a user names a city
early and asks about "where I live" later, so the compressed layers must carry it).

Cities are made up, from syllables or from random letters, or real places (demo/places.py), so the
model learns to copy what the user wrote rather than to recall a list; the first training steps see
echo samples alone (`training_sets`); and weather questions are composed from parts (with a
sentence of plain English before or after half of them, and everyday words right after the name
in a quarter: demo/words.py), so that it cannot copy from a fixed position in a template nor from
whatever follows a piece it has just written. The acceptance test
holds out its own cities and phrasings (tests/server/test_demo_model.py) and checks that neither
occurs here (no user turn is a held-out phrasing, whatever the name in it).
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass

from demo import words
from demo.places import MORE_PLACES, TRAIN_CITIES

from dsv4.chat import encode_messages

# Made-up names are built from letters, not from a short list of syllables: their pieces cover most
# of what the tokenizer can split a real name into, so the only way to get the argument right is to
# copy it from the user's words (a fixed syllable set taught the model to recall names instead).
# A piece listed twice is drawn twice as often.
_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "b", "c", "d",
           "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "y", "q", "x", "br", "bl", "ch", "cl", "cr", "dr",
           "fl", "fr", "gl", "gr", "kr", "pr", "pl", "sh", "sk", "sl", "sp", "st", "tr", "th", "ts", "zh", "gd",
           "lj", "kh", "ph", "sv"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "a", "e", "o", "y", "ae",
           "ai", "au", "ea", "ei", "ia", "ie", "io", "ou", "ua"]
_CODAS = ("",) * 45 + ("n", "r", "l", "s", "k", "m", "t", "d", "n", "r", "l", "s", "ng", "nd", "rg", "sk", "st",
                       "nt", "rd", "lt", "sh", "x", "z", "ck", "ll", "nn", "tt", "ss")
_FIRST_WORDS = ("La", "El", "San", "Santa", "Port", "New", "Nova", "Saint", "Los", "Las", "Fort", "Lake", "Mount",
                "Phnom", "Kuala", "Nizhny", "Puerto", "Ciudad", "Bad", "Novo")
_SUFFIXES = ("", "", "", "", "", "", " Bay", " City", " Falls", " Harbor", "ville", "burg", "ton", " Springs",
             "grad", "abad", "pur", "stad", "holm", "by", "ia", "ovo", "sk", "ea", " Beach", " Hills")
TIMEZONES = ["Europe/Paris", "Europe/London", "Europe/Berlin", "Asia/Tokyo", "Asia/Kolkata", "Asia/Dubai",
             "America/New_York", "America/Chicago", "America/Denver", "America/Los_Angeles",
             "America/Sao_Paulo", "Australia/Sydney", "Africa/Cairo", "Africa/Nairobi", "Pacific/Auckland",
             "UTC", "Asia/Singapore", "Europe/Madrid", "Europe/Moscow", "Asia/Seoul"]
UNITS = [("km", "miles", 0.621371), ("miles", "km", 1.609344), ("kg", "pounds", 2.204623),
         ("pounds", "kg", 0.453592), ("celsius", "fahrenheit", None), ("meters", "feet", 3.28084),
         ("liters", "gallons", 0.264172), ("inches", "cm", 2.54)]
SKIES = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "stormy"]
TOPICS = ["the tallest mountain", "the speed of light", "the largest ocean", "the first moon landing",
          "how bees make honey", "the boiling point of water", "the longest river", "why the sky is blue",
          "the history of tea", "how rainbows form", "the population of Canada", "the inventor of the telephone"]
NAMES = ["Alice", "Bob", "Carmen", "Dmitri", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Leo",
         "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara"]


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = {
    "get_weather": _tool("get_weather", "Get the current weather for a city.",
                         {"city": {"type": "string", "description": "The city name"}}, ["city"]),
    "get_time": _tool("get_time", "Get the current local time in a timezone.",
                      {"timezone": {"type": "string", "description": "An IANA timezone"}}, ["timezone"]),
    "calculator": _tool("calculator", "Evaluate an arithmetic expression.",
                        {"expression": {"type": "string"}}, ["expression"]),
    "convert_units": _tool("convert_units", "Convert a value between units.",
                           {"value": {"type": "number"}, "from_unit": {"type": "string"},
                            "to_unit": {"type": "string"}}, ["value", "from_unit", "to_unit"]),
    "search": _tool("search", "Search the web.", {"query": {"type": "string"}}, ["query"]),
}

# Weather questions are composed from parts (an opener, a request that names the city, a closing), so
# that no fixed phrase marks where a name starts: a model trained on a handful of templates learns to
# copy from a template position and fails on the first phrasing it has not seen.
WEATHER_OPENERS = ("", "", "", "", "Hi! ", "Hello. ", "Hey, ", "Quick question: ", "Ok. ", "Please, ", "Sorry, ",
                   "I have a trip planned. ", "One more thing. ", "Good morning! ", "Help me out: ", "So, ")
WEATHER_REQUESTS = (
    "what is the weather in {city}", "what's the weather like in {city}", "how is the weather in {city}",
    "weather in {city}", "tell me the weather in {city}", "is it sunny in {city}", "do I need an umbrella in {city}",
    "how warm is it in {city}", "check the weather for {city}", "can you get the weather for {city}",
    "what's the temperature in {city}", "give me the forecast for {city}", "weather {city}",
    "is it raining in {city}", "how windy is it in {city}", "what is the sky like over {city}",
    "current conditions in {city}", "{city} weather", "what's it doing outside in {city}",
    "get me the weather in {city}", "will it snow in {city}", "how hot is {city}", "I'm visiting {city}, what's the weather",
    "my sister lives in {city}. What is the weather there", "the weather in {city}", "look up {city}'s weather",
    "forecast {city}", "temperature in {city}", "is {city} sunny",
    "I am going to {city}. What is the weather there", "fetch the weather for {city}", "weather at {city} now",
    "how does the weather look in {city}", "tell me about the weather around {city}", "{city}: weather",
    "what is the weather doing in {city}", "could you check how the weather is in {city}",
    "let me know the weather in {city}", "I'd like the weather for {city}", "what does the forecast say for {city}",
    "is the weather nice in {city}", "how are conditions in {city}", "please check {city}'s forecast",
    "are there clouds over {city}", "is there rain in {city}", "what's the outlook for {city}",
    "how is it outside in {city}", "is it freezing in {city}", "is it warm enough for shorts in {city}",
    "do I need sunscreen in {city}", "should I take an umbrella to {city}", "can you find the weather in {city}",
    "I need the weather in {city}", "what will the weather be in {city}", "how many degrees is it in {city}",
    "is it humid in {city}", "check if it's raining in {city}", "what are the conditions like in {city}",
    "would you look up the weather in {city}", "can you tell me if it's sunny in {city}",
    "is it a nice day in {city}", "any rain in {city}", "how's {city} looking",
    "I wonder what the weather is in {city}", "show me the weather in {city}", "is it stormy in {city}",
    "how chilly is it in {city}", "is it nice out in {city}", "can I go for a walk in {city} or is it wet",
    "what should I wear in {city}", "is the sun out in {city}", "will I need gloves in {city}",
    "tell me how warm {city} is", "what is the air like in {city}", "get the current weather for {city}",
    "is it foggy in {city}", "are the roads icy in {city}", "how is the sky in {city}",
    "is it good beach weather in {city}", "my flight goes to {city}. How is the weather there",
    "we are meeting friends in {city}. Is it dry there", "what weather can I expect in {city}",
)
WEATHER_CLOSINGS = ("?", "?", "?", ".", "", " today?", " right now?", " please.", " now?", " this morning?",
                    ", please?", " tonight?", " for me?", "? Thanks.", "!", " this weekend?", " later today?",
                    " tomorrow morning?", " around noon?", " during my visit?", " for the next few hours?",
                    " before I leave?", " when I land?", " these days?", " by the sea?", " this afternoon?",
                    " at the airport?", " on Saturday?", " in the evening?", " thanks!", ", thank you.")
# Sentences said before or after the question (in half of them): plain English whose words the tokenizer
# splits into short pieces, as it splits any phrasing it was not trained on. Those pieces are the same
# kind as a name's ("garage " -> "g", "ar", "ag", "e "), so the model has to learn to copy the name
# itself, not whatever piece follows the one it just wrote.
_WHO = ("I", "We", "My brother", "My aunt", "Our neighbours", "My boss", "The kids", "My friend", "My partner",
        "Our team", "My grandmother", "Two colleagues")
_DOING = ("am flying out", "will be driving to the coast", "want to walk the dog", "are going to the beach",
          "have a long layover", "plan to paint the fence", "need to dry the laundry outside", "am cycling to work",
          "will watch the parade", "are camping near the lake", "have an early ferry", "want to play tennis",
          "are hosting a barbecue", "have a wedding to attend", "might go hiking in the hills",
          "are moving house", "will be selling vegetables at the market", "have tickets for an outdoor concert",
          "want to fly a kite", "are taking the children to the zoo", "need to fix the roof",
          "are repainting the garage", "have a picnic planned", "am running a half marathon",
          "will be waiting for a delayed train", "want to photograph the old harbour")
_WHEN = ("tomorrow", "this weekend", "tonight", "on Monday", "next week", "after lunch", "in the evening",
         "before sunrise", "later today", "on Friday", "soon", "in an hour")
_SAYINGS = ("The news mentioned a storm.", "I left my umbrella at the office.", "I have not looked outside yet.",
            "The trains were late yesterday.", "My phone's weather widget is broken.", "Thanks in advance.",
            "I'm packing my suitcase right now.", "It was lovely there last spring.", "Just wondering.",
            "This is for a school project.", "I hope it stays dry.", "Sorry for all the questions.")


def context_sentence(rng: random.Random) -> str:
    draw = rng.random()
    if draw < 0.2:
        return rng.choice(_SAYINGS)
    if draw < 0.5:
        return f"{rng.choice(_WHO)} {rng.choice(_DOING)} {rng.choice(_WHEN)}."
    thing = everyday_thing(rng)
    return f"{rng.choice(_WHO)} {rng.choice(words.VERBS)} {'an' if thing[0] in 'aeiou' else 'a'} {thing} {rng.choice(_WHEN)}."


def everyday_thing(rng: random.Random) -> str:
    return f"{rng.choice(words.ADJECTIVES)} {rng.choice(words.NOUNS)}"


def rare_closing(rng: random.Random) -> str:
    """Rare words straight after the name ("... in Kabul before my spare tent arrives?"): the name ends
    where its capitalised word does, not where familiar tokens start again."""
    thing = everyday_thing(rng)
    return rng.choice((f" before my {thing} arrives?", f" for my {thing}?", f" where I {rng.choice(words.VERBS)} my {thing}?",
                       f" near the {thing} shop?", f", and is it good for my {thing}?"))


def weather_question(rng: random.Random, city: str) -> str:
    request = rng.choice(WEATHER_REQUESTS).format(city=city)
    opener = rng.choice(WEATHER_OPENERS)
    if not opener or opener.endswith((". ", "! ", ": ")):
        request = request[0].upper() + request[1:]
    question = opener + request + (rare_closing(rng) if rng.random() < 0.25 else rng.choice(WEATHER_CLOSINGS))
    draw = rng.random()
    if draw < 0.25:
        return f"{context_sentence(rng)} {question}"
    return f"{question} {context_sentence(rng)}" if draw < 0.5 else question


TIME_PHRASINGS = ["What time is it in {tz}?", "Tell me the current time in {tz}.", "Time in {tz}, please.",
                  "Can you check the local time for {tz}?"]
CALC_PHRASINGS = ["Use the calculator: {expr}", "Calculate {expr}.", "What is {expr}? Use the calculator.",
                  "Please compute {expr}."]
CONVERT_PHRASINGS = ["Convert {value} {src} to {dst}.", "How many {dst} is {value} {src}?",
                     "Please convert {value} {src} into {dst}."]
SEARCH_PHRASINGS = ["Search the web for {topic}.", "Look up {topic}.", "Can you search for {topic}?",
                    "Find information about {topic}."]
GREETINGS = [("Hello!", "Hello! How can I help you today?"), ("Hi", "Hi! What can I do for you?"),
             ("Good morning!", "Good morning! How can I help?"), ("Hey there", "Hey! How can I help you?"),
             ("How are you?", "I am doing well, thank you. How can I help you?"),
             ("Thank you!", "You're welcome!"), ("Thanks a lot.", "Happy to help!"),
             ("Who are you?", "I am a small demo assistant. I can chat, do simple math and call tools."),
             ("What can you do?", ("I can chat, add and subtract numbers, and call tools such as the weather, "
              "the time, a calculator, unit conversion and search.")),
             ("Bye!", "Goodbye! Have a nice day."), ("Good night.", "Good night! Sleep well.")]


@dataclass(frozen=True)
class Sample:
    text: str  # the whole conversation, encoded
    thinking: bool
    copied: tuple[str, ...] = ()  # what the assistant copies: names from the user, temperatures from a tool (weighted up)


def made_up_word(rng: random.Random) -> str:
    syllables = rng.choices((1, 2, 3, 4), (0.15, 0.5, 0.28, 0.07))[0]
    word = "".join(rng.choice(_ONSETS) * (i > 0 or rng.random() < 0.85) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for i in range(syllables))
    return word.capitalize()


def made_up_city(rng: random.Random) -> str:
    shape = rng.random()
    if shape < 0.1:
        return f"{rng.choice(_FIRST_WORDS)} {made_up_word(rng)}"
    if shape < 0.15:
        return f"{made_up_word(rng)} {made_up_word(rng)}"
    return made_up_word(rng) + rng.choice(_SUFFIXES)


def letters_name(rng: random.Random) -> str:
    """Random letters: no syllable statistics to guess the next piece from, so copying is the only way
    to say the name back (trained on name-like names alone, a small model half-copies, half-invents:
    "Antwerp" -> "Antpoupest")."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9))).capitalize()


def pick_city(rng: random.Random) -> str:
    """30% random letters, 30% a real place (TRAIN_CITIES or MORE_PLACES, half each), 40% a made-up name."""
    draw = rng.random()
    if draw < 0.3:
        return letters_name(rng)
    if draw < 0.6:
        return rng.choice(TRAIN_CITIES if draw < 0.45 else MORE_PLACES)
    return made_up_city(rng)


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


class _Session:
    """Builds one conversation turn by turn; `reasoning` is only used in thinking mode."""

    def __init__(self, rng: random.Random, thinking: bool, tools: list[str]):
        self.rng, self.thinking, self.tools = rng, thinking, tools
        self.messages: list[dict] = []
        self.calls = 0
        self.copied: set[str] = set()

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def answer(self, content: str, reasoning: str) -> None:
        msg = {"role": "assistant", "content": content}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        self.messages.append(msg)

    def tool_round(self, name: str, arguments: dict, result: dict, final: str, reasoning: str) -> None:
        self.calls += 1
        call_id = f"call_{self.calls}"
        msg = {"role": "assistant", "content": "", "tool_calls": [_call(call_id, name, arguments)]}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        self.messages.append(msg)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})
        self.answer(final, "The tool returned the result. I will answer with it.")

    def render(self) -> Sample:
        tools = [TOOLS[name] for name in self.tools] or None
        return Sample(encode_messages(self.messages, tools=tools, thinking=self.thinking), self.thinking,
                      tuple(sorted(self.copied)))


def _weather_turn(s: _Session, city: str, phrasing: str | None = None) -> None:
    rng = s.rng
    s.copied.add(city)
    s.user(phrasing.format(city=city) if phrasing else weather_question(rng, city))
    temp, sky = rng.randint(-10, 38), rng.choice(SKIES)
    s.copied.add(str(temp))  # from the tool result into the answer
    s.tool_round("get_weather", {"city": city}, {"city": city, "temp_c": temp, "sky": sky},
                 f"It is {temp}°C and {sky} in {city}.",
                 f"The user wants the weather in {city}. I will call get_weather with {city}.")


def _time_turn(s: _Session) -> None:
    rng = s.rng
    tz = rng.choice(TIMEZONES)
    s.user(rng.choice(TIME_PHRASINGS).format(tz=tz))
    time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    s.tool_round("get_time", {"timezone": tz}, {"timezone": tz, "time": time}, f"It is {time} in {tz}.",
                 f"The user wants the time in {tz}. I will call get_time.")


def _expression(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    op = rng.choice("+-*")
    return f"{a} {op} {b}", {"+": a + b, "-": a - b, "*": a * b}[op]


def _calc_turn(s: _Session) -> None:
    expr, value = _expression(s.rng)
    s.user(s.rng.choice(CALC_PHRASINGS).format(expr=expr))
    s.tool_round("calculator", {"expression": expr}, {"result": value}, f"{expr} = {value}.",
                 f"I will call the calculator with {expr}.")


def _convert_turn(s: _Session) -> None:
    rng = s.rng
    src, dst, factor = rng.choice(UNITS)
    value = rng.randint(1, 200)
    result = round(value * 9 / 5 + 32, 1) if factor is None else round(value * factor, 2)
    s.user(rng.choice(CONVERT_PHRASINGS).format(value=value, src=src, dst=dst))
    s.tool_round("convert_units", {"value": value, "from_unit": src, "to_unit": dst}, {"value": result, "unit": dst},
                 f"{value} {src} is {result} {dst}.", f"I will convert {value} {src} to {dst}.")


def _search_turn(s: _Session) -> None:
    rng = s.rng
    topic = rng.choice(TOPICS)
    s.user(rng.choice(SEARCH_PHRASINGS).format(topic=topic))
    title = f"All about {topic}"
    s.tool_round("search", {"query": topic}, {"results": [{"title": title, "url": "https://example.org/1"}]},
                 f"I found this: {title} (https://example.org/1).", f"I will search for {topic}.")


def _arithmetic_turn(s: _Session) -> None:
    rng = s.rng
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.5:
        s.user(f"What is {a} plus {b}?" if rng.random() < 0.5 else f"What is {a} + {b}?")
        s.answer(f"{a} + {b} = {a + b}.", f"I add {a} and {b}: {a + b}.")
    else:
        a, b = max(a, b), min(a, b)
        s.user(f"What is {a} minus {b}?" if rng.random() < 0.5 else f"What is {a} - {b}?")
        s.answer(f"{a} - {b} = {a - b}.", f"I subtract {b} from {a}: {a - b}.")


def _small_talk_turn(s: _Session) -> None:
    question, reply = s.rng.choice(GREETINGS)
    s.user(question)
    s.answer(reply, "The user is chatting. I will reply politely.")


_TOOL_TURNS = {"get_time": _time_turn, "calculator": _calc_turn, "convert_units": _convert_turn,
               "search": _search_turn}


def weather_sample(rng: random.Random) -> Sample:
    """One weather request (the most frequent pattern): a tool list with get_weather, maybe others."""
    others = [name for name in TOOLS if name != "get_weather" and rng.random() < 0.15]
    tools = ["get_weather"] + others
    rng.shuffle(tools)
    s = _Session(rng, rng.random() < 0.3, tools)
    if rng.random() < 0.2:
        _small_talk_turn(s)
    _weather_turn(s, pick_city(rng))
    return s.render()


def tool_sample(rng: random.Random) -> Sample:
    name = rng.choice(list(_TOOL_TURNS))
    tools = [name] + [other for other in TOOLS if other != name and rng.random() < 0.15]
    rng.shuffle(tools)
    s = _Session(rng, rng.random() < 0.3, tools)
    _TOOL_TURNS[name](s)
    return s.render()


def chat_sample(rng: random.Random) -> Sample:
    s = _Session(rng, rng.random() < 0.3, [])
    for _ in range(rng.randint(1, 3)):
        (_arithmetic_turn if rng.random() < 0.5 else _small_talk_turn)(s)
    return s.render()


ECHO_PHRASINGS = ["Please repeat after me: {words}", "Say this back to me: {words}", "Repeat exactly: {words}",
                  "Can you echo this? {words}", "Copy these names: {words}", "{words}. Say those back, please.",
                  "I wrote {words} on a card. Repeat them.", "Echo {words} back to me.",
                  "Names: {words}. Repeat them exactly.", "My list is {words}; read it back."]


def echo_sample(rng: random.Random) -> Sample:
    """The user asks for a few city names (mostly made up) back, verbatim: the plainest copying there
    is, and what a tool argument needs (these turns are where the model learns to copy a name it has
    never seen)."""
    s = _Session(rng, rng.random() < 0.3, [])
    names = [pick_city(rng) for _ in range(rng.randint(2, 6))]
    s.copied.update(names)
    words = ", ".join(names)
    s.user(rng.choice(ECHO_PHRASINGS).format(words=words))
    s.answer(words, "The user wants the words back exactly. I will repeat them.")
    return s.render()


def long_session(rng: random.Random) -> Sample:
    """A session past the sliding window: the user says where they live, chats, then asks about home."""
    tools = list(TOOLS)
    rng.shuffle(tools)
    s = _Session(rng, rng.random() < 0.3, tools)
    home, name = pick_city(rng), rng.choice(NAMES)
    s.copied.add(home)
    s.user(f"Hi, I am {name} and I live in {home}.")
    s.answer(f"Nice to meet you, {name}! {home} sounds lovely.", f"The user is {name} from {home}.")
    for _ in range(rng.randint(2, 4)):
        turn = rng.random()
        if turn < 0.3:
            _weather_turn(s, pick_city(rng))
        elif turn < 0.6:
            _TOOL_TURNS[rng.choice(list(_TOOL_TURNS))](s)
        else:
            (_arithmetic_turn if rng.random() < 0.5 else _small_talk_turn)(s)
    if rng.random() < 0.5:
        _weather_turn(s, home, rng.choice(["What is the weather where I live?", "How is the weather at home?",
                                           "And the weather in my city?"]))
    else:
        s.user(rng.choice(["Where do I live?", "Do you remember my city?", "What is my name?"]))
        if "name" in s.messages[-1]["content"]:
            s.answer(f"Your name is {name}.", f"The user said their name is {name}.")
        else:
            s.answer(f"You live in {home}.", f"The user said they live in {home}.")
    return s.render()


MIX = ((weather_sample, 0.4), (tool_sample, 0.15), (chat_sample, 0.05), (echo_sample, 0.3), (long_session, 0.1))


def generate(n: int, seed: int = 0) -> list[Sample]:
    """`n` samples, the same for the same (n, seed)."""
    rng = random.Random(seed)
    makers, weights = zip(*MIX)
    return [rng.choices(makers, weights)[0](rng) for _ in range(n)]


def training_sets(samples: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """What scripts/train_demo.py trains on: the copy warm-up's echo samples (a quarter as many, from
    seed + 1) and the main mix of `samples`."""
    echo_rng = random.Random(seed + 1)
    return [echo_sample(echo_rng) for _ in range(samples // 4)], generate(samples, seed)


def trained_text(training: dict) -> str:
    """All the text a model was trained on, regenerated from its training.json (seed and samples)."""
    warmup, mix = training_sets(training["samples"], training["seed"])
    return "\n".join(sample.text for sample in warmup + mix)


def phrasings_in(text: str, phrasings: list[str]) -> list[str]:
    """The phrasings ("... {city} ...") that some user turn of `text` is, with any name in the city's place."""
    user_turns = set(re.findall("<｜User｜>(.*?)<｜Assistant｜>", text, re.DOTALL))
    patterns = {phrasing: re.compile(".+".join(re.escape(part) for part in phrasing.split("{city}")))
                for phrasing in phrasings}
    return [phrasing for phrasing, pattern in patterns.items() if any(pattern.fullmatch(turn) for turn in user_turns)]
