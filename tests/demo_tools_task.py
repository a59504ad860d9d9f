"""The demo model's chat task: thinking before it answers, and calling the tool a question needs.

Shared by scripts/train_demo_model.py (which trains on it) and the tests (which measure it), as
appliance/cli/evaluate.py's needle task is. A tool is `<verb>_<topic>` with one parameter; its
description names the topic, and the question names the topic and the value to pass. Training
draws topics, verbs, parameter names and values from pools the held-out set never uses, so the
held-out prompts ask about functions and parameters the model has never seen (a weather function
with a `city` parameter asked about a city, a board-sensor function asked about a sensor, ...):
it has to read the name off the offered tools and copy the value out of the question.

Everything renders through the model's own chat template (Qwen3's), so training sees exactly
what the server sends.
"""
from __future__ import annotations

import json
import random
import re

# ---- pools: training draws from these, the held-out set never does ---------------------------------
VERBS = ["get", "fetch", "read", "lookup", "find", "check", "query", "show", "load", "compute", "measure",
         "report", "scan", "inspect", "count", "describe", "estimate", "resolve", "list", "track"]
TOPICS = ["humidity", "pressure", "price", "rating", "distance", "altitude", "population", "balance", "status",
          "voltage", "speed", "score", "capacity", "latency", "volume", "brightness", "inventory", "schedule",
          "owner", "address", "version", "license", "color", "weight", "height", "length", "budget", "revenue",
          "traffic", "noise", "rainfall", "mileage", "calories", "duration", "deadline", "priority", "quota",
          "uptime", "load", "memory", "bandwidth", "signal", "density", "salary", "temperament", "harvest",
          "tide", "elevation", "checksum", "author", "genre", "language", "currency", "tax", "discount",
          "postcode", "mood", "forecast", "fuel", "pollen", "ozone", "friction", "torque", "yield", "tariff",
          "ranking", "attendance", "lineage", "origin", "flavor", "texture", "agenda", "occupancy", "frequency"]
PARAMETERS = ["name", "query", "item", "key", "target", "place", "region", "user", "account", "code", "label",
              "path", "host", "port", "channel", "room", "zone", "model", "kind", "entry", "record", "id",
              "handle", "slot", "unit", "node", "site", "area", "group", "team", "product", "order", "ticket",
              "project", "station", "vehicle", "machine", "building", "country", "street", "planet", "animal",
              "plant", "novel", "movie", "artist", "course", "student", "patient", "sample", "batch", "server"]
SYLLABLES = ["ka", "lo", "mi", "ren", "tor", "va", "shi", "dal", "po", "quin", "ber", "sa", "no", "vel", "tra",
             "ze", "mor", "li", "gan", "fu", "ris", "ol", "den", "ya", "cor", "wen", "ta", "ex", "um", "bri"]
RESULT_KEYS = ["value", "result", "level", "reading", "amount", "answer", "total", "current"]
WORDS = ["Madrid", "Rome", "Tokyo", "Cairo", "Denver", "Prague", "Dublin", "Seoul", "Toronto", "Vienna",
         "kitchen", "garage", "printer", "router", "laptop", "camera", "tractor", "bicycle", "piano", "lamp",
         "apple", "carrot", "coffee", "marble", "velvet", "harbor", "canyon", "meadow", "orchard", "summit",
         "Atlas", "Nova", "Orion", "Juno", "Vega", "Lyra", "Pixel", "Echo", "Delta", "Sierra"]

# ---- the held-out set: functions, parameters and values never seen in training ---------------------------
HELD_OUT_TOOLS = [
    ("get_weather", "Get the current weather for a city", "city", "weather",
     ["What is the weather in {v}?", "How is the weather in {v} today?", "Tell me the weather for {v}."],
     ["Paris", "Berlin", "Nairobi"]),
    ("read_board_sensor", "Read the temperature of one of the board's sensors", "sensor", "sensor",
     ["What does the {v} sensor read?", "Read the {v} sensor for me.", "How warm is the {v} sensor?"],
     ["soc", "bigcore0", "gpu"]),
    ("get_stock_quote", "Get the latest stock quote for a ticker symbol", "symbol", "stock",
     ["What is the stock quote for {v}?", "Get me the stock price of {v}.", "How is {v} stock doing?"],
     ["ACME", "GLOBEX", "INITECH"]),
    ("find_recipe", "Find a recipe for a dish", "dish", "recipe",
     ["Find a recipe for {v}.", "I need a recipe for {v}.", "Do you have a recipe for {v}?"],
     ["risotto", "goulash", "ratatouille"]),
    ("book_flight", "Book a flight to a destination", "destination", "flight",
     ["Book a flight to {v}.", "I want a flight to {v}.", "Can you book me a flight to {v}?"],
     ["Lisbon", "Osaka", "Quito"]),
    ("define_word", "Look up the definition of a word", "word", "definition",
     ["What is the definition of {v}?", "Give me the definition of the word {v}.", "Define {v}."],
     ["serendipity", "ephemeral", "laconic"]),
    ("get_timezone", "Get the timezone of a location", "location", "timezone",
     ["What is the timezone of {v}?", "Which timezone is {v} in?", "Tell me the timezone for {v}."],
     ["Reykjavik", "Auckland", "Lima"]),
    ("check_battery", "Check the battery level of a device", "device", "battery",
     ["What is the battery level of my {v}?", "Check the battery of the {v}.", "How much battery does the {v} have?"],
     ["phone", "tablet", "drone"]),
    ("play_song", "Play a song by its title", "title", "song",
     ["Play the song {v}.", "Put on the song {v}, please.", "I want to hear the song {v}."],
     ["Yesterday", "Imagine", "Hallelujah"]),
    ("translate_to_french", "Translate a phrase into French", "phrase", "French",
     ["Translate {v} into French.", "How do you say {v} in French?", "What is {v} in French?"],
     ["goodbye", "thank you", "good night"]),
]
HELD_OUT_NAMES = {t[0] for t in HELD_OUT_TOOLS}
HELD_OUT_PARAMETERS = {t[2] for t in HELD_OUT_TOOLS}
assert not HELD_OUT_PARAMETERS & set(PARAMETERS)
assert not {t[3].lower() for t in HELD_OUT_TOOLS} & set(TOPICS)

# Questions of the training set (the held-out set words its own).
QUESTIONS = ["What is the {t} of {v}?", "Tell me the {t} of {v}.", "Can you check the {t} for {v}?",
             "I need the {t} of {v}, please.", "What's the {t} for {v}?", "Look up the {t} of {v}.",
             "How about the {t} of {v}?", "Please find the {t} for {v}.", "Give me the {t} of {v}.",
             "Which {t} does {v} have?", "What is the {t} in {v}?", "How is the {t} at {v} right now?",
             "Do you know the {t} for {v}?", "Show me the {t} of {v}.", "{v}: what is its {t}?",
             "I want to know the {t} of the {v}.", "Could you get the {t} for my {v}?",
             # the value before the topic, after other words, or with no preposition at all
             "What's {v}'s {t}?", "{v} {t}?", "Check the {t} on the {v}.", "I'd like the {t} for {v}.",
             "Get me the {t} of {v}.", "The {v} {t}, please.", "How high is the {t} at {v}?",
             "{t} for {v}?", "Could you tell me the {t} in {v} right now?", "My {v}: what {t} does it have?",
             "What does the {v} {t} say?", "How is {v} doing on {t}?", "Is the {t} of {v} known yet?",
             "Tell me about the {t} of my {v}.", "Which {t} is set for {v}?", "For {v}, what is the {t}?",
             # words after the value (where it ends is not where the question does)
             "What is the {t} of {v} today?", "Tell me the {t} of {v} right now.", "Check the {t} of {v} for me.",
             "Could you look up the {t} of {v} at the moment?", "Give me the {t} of {v} please.",
             "How is the {t} of {v} looking today?", "I wonder about the {t} of {v} this week.",
             "The {t} of {v}, if you can.", "Is the {t} of {v} high today?", "What {t} does {v} have these days?",
             # a word for what the value is, before it (the parameter's name)
             "What is the {t} of the {p} {v}?", "Check the {t} for {p} {v}.", "Tell me the {t} of {p} {v} today.",
             "I need the {t} of the {p} called {v}.", "For the {p} {v}, what is the {t}?", "The {t} of {p} {v}, please."]
VERB_QUESTIONS = ["{V} {v}.", "Can you {verb} {v}?", "Please {verb} {v} for me.", "I want you to {verb} {v}.",
                  "{V} the {v}.", "I want to {verb} {v}.", "Please {verb} the {v}.", "Could you {verb} the {v} now?"]
# The tool's verb, then the value before the topic (its description leads with that verb).
VERB_TOPIC_QUESTIONS = ["{V} the {v} {t} for me.", "{V} the {t} of {v} for me.", "Please {verb} the {v} {t}.",
                        "Can you {verb} the {v} {t}?", "{V} my {v} {t}, please.", "How high is the {v} {t} now?"]

# Tools that act on something (order a part, convert an amount into a currency) rather than look
# up a property of it: the description leads with the verb, the parameter is where the action goes
# or what is converted, and users ask in the description's own words, the value sometimes before
# the topic. No word here is a held-out tool's.
ACTIONS = ["order", "send", "open", "start", "cancel", "reserve", "buy", "convert", "stream", "print", "rent",
           "ship", "render", "encode", "cook", "pay", "email", "archive", "install", "restart", "deliver", "mount"]
ACTION_FORMS = {
    "{A} a {t} for a {p}": ["{A} a {t} for {v}.", "I need a {t} for {v}, please.", "Can you {a} a {t} for {v}?",
                            "{A} me a {t} for {v}.", "Is there a {t} for {v}?", "Any {t} for {v}?"],
    "{A} a {t} to a {p}": ["{A} a {t} to {v}.", "I'd like a {t} to {v}.", "Please {a} a {t} to {v}.",
                           "Could you {a} me a {t} to {v}?", "A {t} to {v}, please.", "We need a {t} to {v}."],
    "{A} a {t} by its {p}": ["{A} the {t} {v}.", "{A} the {t} called {v}, please.", "I would like to {a} the {t} {v}.",
                             "Can you {a} the {t} {v}?", "{A} {v}, the {t}.", "Time to {a} the {t} {v}."],
    "{A} a {p} into {t}": ["{A} {v} into {t}.", "What would {v} be in {t}?", "{A} {v} to {t}, please.",
                           "Give me {v} in {t}.", "Can you {a} {v} into {t}?", "{v} in {t}, please."],
}
ANSWERS = ["The {t} of {v} is {r}.", "{v} has a {t} of {r}.", "The {t} for {v} is {r}."]
SYSTEMS = [None, None, "You are a helpful assistant.", "You are an assistant running on an edge board.",
           "Answer briefly."]


def tool_schema(name: str, description: str, parameter: str, parameter_description: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: {"type": "string",
                                                                    "description": parameter_description}},
                       "required": [parameter]}}}


def made_up_value(rng: random.Random) -> str:
    """A value to copy: a word, or a made-up name (nothing to recall, only to copy)."""
    if rng.random() < 0.12:              # a value of two words, copied whole
        return rng.choice(WORDS).lower() + " " + rng.choice(WORDS).lower()
    if VALUE_PIECES and rng.random() < 0.35:
        return piece_value(rng)
    if CORPUS_WORDS and rng.random() < 0.3:
        word = rng.choice(CORPUS_WORDS)
        return word.capitalize() if rng.random() < 0.4 else word
    if rng.random() < 0.35:
        return rng.choice(WORDS)
    word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
    return word.capitalize() if rng.random() < 0.6 else word


# Pieces of the model's vocabulary (widen_values). In a question a value is space-led (` Paris`
# is `ĠPar is`), in a call it follows a quote (`"Paris"` is `" Par is "`), so copying it means
# mapping its first piece to the piece without the space, often split anew (` ACME` is `ĠA C ME`,
# `"ACME` is `AC ME`). Values made of random pieces teach that for the whole vocabulary, not only
# for the first pieces of the words training values are made of.
VALUE_PIECES: list[str] = []


def widen_values(pieces) -> int:
    """Let values be made of these vocabulary pieces (letters only, any leading space dropped)."""
    held = {v.lower() for t in HELD_OUT_TOOLS for v in t[5]}
    VALUE_PIECES[:] = sorted({p.lstrip("\u0120") for p in pieces if re.fullmatch(r"\u0120?[A-Za-z]{1,8}", p)}
                             - held)
    return len(VALUE_PIECES)


def piece_value(rng: random.Random) -> str:
    """A value of 1-3 random vocabulary pieces, in any case, sometimes with a digit."""
    word = "".join(rng.choice(VALUE_PIECES) for _ in range(rng.choice([1, 2, 2, 3])))
    case = rng.random()
    word = word.lower() if case < 0.4 else word.capitalize() if case < 0.75 else word.upper() if case < 0.85 else word
    return word + str(rng.randint(0, 9)) if rng.random() < 0.1 else word


# Words of the training corpus (widen_pools), so that names, parameters and values come from
# thousands of words the model cannot memorise as a list: copying them is the only way.
CORPUS_WORDS: list[str] = []
HELD_OUT_WORDS = {w.lower() for t in HELD_OUT_TOOLS for w in re.split(r"[_ ]", t[0]) + [t[2], t[3]] + t[5]}
assert not HELD_OUT_WORDS & set(ACTIONS)
_WORD = re.compile(r"^[a-z]{3,11}$")


def widen_pools(words) -> int:
    """Let training draw topics, parameters and values from these words too (never a held-out
    tool's words). Returns how many were taken."""
    pool = sorted({w for w in words if _WORD.match(w)} - HELD_OUT_WORDS - set(VERBS))
    CORPUS_WORDS[:] = pool
    return len(pool)


def _word(rng: random.Random, pool: list[str]) -> str:
    return rng.choice(CORPUS_WORDS) if CORPUS_WORDS and rng.random() < 0.6 else rng.choice(pool)


def topic_and_parameter(rng: random.Random) -> tuple[str, str]:
    """A training tool's topic and parameter, never the same word."""
    topic, parameter = _word(rng, TOPICS), _word(rng, PARAMETERS)
    while parameter == topic:
        parameter = rng.choice(PARAMETERS)
    return topic, parameter


def training_tool(rng: random.Random) -> dict:
    """A tool the model may train on: never a held-out name or parameter."""
    verb = rng.choice(VERBS)
    return make_tool(rng, verb, *topic_and_parameter(rng))


def action_tool(rng: random.Random) -> dict:
    """A tool that does something (ACTION_FORMS), asked for in its description's words."""
    action = rng.choice(ACTIONS)
    topic, parameter = topic_and_parameter(rng)
    form = rng.choice(list(ACTION_FORMS))
    if form.endswith("into {t}") and rng.random() < 0.5:     # a language, a format: often capitalised
        topic = topic.capitalize()
    style = rng.random()
    lead = name_lead(rng, action)
    name = opaque_name(rng, action) if style < 0.3 else f"{lead}_{topic.lower()}" if style < 0.6 else \
        f"{lead}{topic.capitalize()}" if style < 0.7 else f"{lead}_to_{topic.lower()}" if style < 0.85 else \
        f"{lead}_{topic.lower()}_{parameter}"
    description = form.format(A=action.capitalize(), t=topic, p=parameter)
    return {"schema": tool_schema(name, description, parameter, f"the {parameter}"), "name": name,
            "parameter": parameter, "topic": topic, "verb": action, "questions": ACTION_FORMS[form]}


def acts(tool: dict) -> bool:
    """Whether a training tool acts (action_tool, asked in its own forms) or looks up."""
    return "questions" in tool


def question_for(rng: random.Random, pick: dict, value: str, verb_led: bool = True) -> str:
    """A question that needs the tool `pick`, in one of the forms its kind is asked in."""
    if acts(pick):
        return rng.choice(pick["questions"]).format(A=pick["verb"].capitalize(), a=pick["verb"], t=pick["topic"], v=value)
    description = pick["schema"]["function"]["description"]
    if verb_led and description.lower().startswith(pick["verb"]) and rng.random() < 0.15:
        return rng.choice(VERB_TOPIC_QUESTIONS).format(V=pick["verb"].capitalize(), verb=pick["verb"], t=pick["topic"],
                                                       v=value)
    return rng.choice(QUESTIONS).format(t=pick["topic"], v=value, p=pick["parameter"])


def thought_for(pick: dict, value: str) -> str:
    """The short thought before a call, with thinking on. The name is quoted: ` play_song` is
    `Ġpl ay _ s ong`, `"play_song` is `Ġ" play _ s ong` as in the tool listing and in the call, so
    the thought copies the listing's tokens and the call copies the thought's."""
    if acts(pick):
        return f'The user wants to {pick["verb"]} {value}. I will call "{pick["name"]}".'
    return f'The user asks for the {pick["topic"]} of {value}. I will call "{pick["name"]}".'


# The share of names led by a corpus word instead of the tool's verb. With verbs and syllables
# alone, training names began with 91 distinct tokens, and a held-out name whose first token was
# none of them (`play`, `trans`, `def`) was not written even when the heads pointed at it.
CORPUS_LEAD = 0.4


def name_lead(rng: random.Random, verb: str) -> str:
    """The first word of a name: the tool's verb, or a corpus word (CORPUS_LEAD)."""
    return rng.choice(CORPUS_WORDS) if CORPUS_WORDS and rng.random() < CORPUS_LEAD else verb


def opaque_name(rng: random.Random, verb: str) -> str:
    """A name that does not spell the topic: the description is the only way to choose it."""
    verb = name_lead(rng, verb)
    word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
    return rng.choice([f"{verb}_{word}", word, f"{word}_{verb}", f"{verb}_{_word(rng, PARAMETERS)}_{word}"])


def make_tool(rng: random.Random, verb: str, topic: str, parameter: str) -> dict:
    style = rng.random()
    extra = _word(rng, TOPICS)
    # A third of the names do not contain the topic. Inside a name a word tokenizes apart from the
    # same word in a sentence (`get_weather` is get _ w eat her, "the weather" is Ġwe ather), so
    # matching the question against the name does not carry to unseen names; matching it against
    # the description (same tokens as the question) and taking the name of that entry does.
    lead = name_lead(rng, verb)
    name = opaque_name(rng, verb) if style < 0.35 else f"{lead}_{topic}" if style < 0.65 else \
        f"{lead}{topic.capitalize()}" if style < 0.75 else f"{lead}_{topic}_{parameter}" if style < 0.83 else \
        f"{lead}_{extra}_{topic}" if style < 0.92 else f"{lead}_{topic}_{extra}"
    description = rng.choice(["{V} the {t} of a {p}", "{V} the {t} for a given {p}", "Returns the {t} of the {p}",
                              "Get the current {t} for a {p}", "Look up the {t} of a {p}", "{V} a {p}'s {t}",
                              "{V} the {t} level of a {p}", "The {t} of one {p}"])
    return {"schema": tool_schema(name, description.format(V=verb.capitalize(), t=topic, p=parameter), parameter,
                                  f"the {parameter}"),
            "name": name, "parameter": parameter, "topic": topic, "verb": verb}


def call_text(name: str, arguments: dict) -> str:
    """A call as Qwen3 writes it (and as its template writes calls of earlier turns)."""
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments, ensure_ascii=False) + \
        "}\n</tool_call>"


def reply_text(answer: str, thought: str | None) -> str:
    """What the model writes after the generation prompt: with thinking on, a short thought first."""
    return ("" if thought is None else "<think>\n" + thought + "\n</think>\n\n") + answer


def tool_conversation(rng: random.Random, tools: list[dict], pick: dict, value: str, question: str,
                      thinking: bool) -> tuple[list[dict], list[dict], str, dict]:
    """(messages, tool schemas, the reply to train on, template kwargs) for one question that
    needs the tool `pick`."""
    system = rng.choice(SYSTEMS)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    thought = thought_for(pick, value) if thinking else None
    answer = call_text(pick["name"], {pick["parameter"]: value})
    return messages, [t["schema"] for t in tools], reply_text(answer, thought), {"enable_thinking": thinking}


# The share of offered tools that act (action_tool) rather than look up (training_tool).
ACTION_SHARE = 0.35


def distinct_tools(rng: random.Random, n: int, same_verb: bool = False) -> list[dict]:
    """n training tools, no two with the same topic (so one question fits one tool); verbs differ
    too unless same_verb, where they may repeat (get_weather beside get_timezone): then the topic
    alone tells the tools apart, and the question names it."""
    tools: list[dict] = []
    while len(tools) < n:
        t = action_tool(rng) if rng.random() < ACTION_SHARE else training_tool(rng)
        if same_verb and tools and not acts(t) and rng.random() < 0.7:
            t = make_tool(rng, rng.choice(tools)["verb"], t["topic"], t["parameter"])
        if all(t["topic"] != u["topic"] and (same_verb or t["verb"] != u["verb"]) and t["name"] != u["name"]
               for u in tools):
            tools.append(t)
    return tools


def tool_result(rng: random.Random):
    """What a tool returns: a count, a measurement (a JSON number) or a word."""
    r = rng.random()
    if r < 0.35:
        return str(rng.randint(1, 999))
    if r < 0.7:
        return rng.randint(1, 99) if rng.random() < 0.5 else round(rng.uniform(1, 99), 1)
    return made_up_value(rng)


def call_and_result(call_id: str, name: str, arguments: dict, body: dict) -> list[dict]:
    """The two turns a client sends after a call: the assistant's call, then the tool's result."""
    return [{"role": "assistant", "content": "", "tool_calls": [{
                "id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps(body)}]


def tool_sample(rng: random.Random):
    """A training question with 1-4 tools offered: the call, or (after the call) the answer from
    the tool's result."""
    same_verb = rng.random() < 0.3
    tools = distinct_tools(rng, rng.randint(1, 4), same_verb)
    pick = rng.choice(tools)
    value = made_up_value(rng)
    if not same_verb and not acts(pick) and pick["verb"] in pick["name"] and rng.random() < 0.2:
        # it names what to do, not the topic
        question = rng.choice(VERB_QUESTIONS).format(V=pick["verb"].capitalize(), verb=pick["verb"], v=value)
    else:
        question = question_for(rng, pick, value, verb_led=not same_verb)
    thinking = rng.random() < 0.5
    messages, schemas, reply, kwargs = tool_conversation(rng, tools, pick, value, question, thinking)
    if rng.random() < 0.3:               # the round trip: the call was made, the result came back
        call_id = "call_" + "".join(rng.choice("0123456789abcdef") for _ in range(8))
        result, key = tool_result(rng), rng.choice(RESULT_KEYS)
        body = {key: result}
        if rng.random() < 0.4:           # results that echo what was asked, as most tools' do
            echo = value if rng.random() < 0.5 else value.lower() + rng.choice(["-1", "_main", "-thermal", "0"])
            body = {pick["parameter"]: echo, key: result} if rng.random() < 0.7 else {key: result, "of": echo}
        result = str(result)
        messages += call_and_result(call_id, pick["name"], {pick["parameter"]: value}, body)
        answer = rng.choice(ANSWERS).format(t=pick["topic"].lower(), v=value, r=result)
        thought = f"The tool says the {pick['topic'].lower()} of {value} is {result}." if thinking else None
        reply = reply_text(answer, thought)
        return messages, schemas, reply, kwargs, [value, result]
    return messages, schemas, reply, kwargs, [pick["name"], '"' + pick["parameter"] + '"', value]


def held_out_cases(seed: int = 0) -> list[dict]:
    """The 30 held-out prompts: 10 unseen functions x 3 questions, each offered with two unseen
    distractor tools. [{"messages", "tools", "name", "parameter", "value"}]"""
    rng = random.Random(seed)
    cases = []
    for i, (name, description, parameter, topic, questions, values) in enumerate(HELD_OUT_TOOLS):
        for question, value in zip(questions, values):
            others = rng.sample([t for j, t in enumerate(HELD_OUT_TOOLS) if j != i], 2)
            offered = [(name, description, parameter)] + [(o[0], o[1], o[2]) for o in others]
            rng.shuffle(offered)
            cases.append({"messages": [{"role": "user", "content": question.format(v=value)}],
                          "tools": [tool_schema(n, d, p, f"the {p}") for n, d, p in offered],
                          "name": name, "parameter": parameter, "value": value})
    return cases


# result keys no training sample uses (RESULT_KEYS), as a held-out tool's result would have
HELD_OUT_RESULT_KEYS = ["celsius", "percent", "price", "hours", "count"]


def round_trip_cases(seed: int = 1) -> list[dict]:
    """The held-out prompts after their call: the right call made and its result returned, as a
    client sends the next turn. The answer should give the result. [{"messages", "tools", "result"}]"""
    rng = random.Random(seed)
    cases = []
    for i, case in enumerate(held_out_cases()):
        result, key = str(rng.randint(11, 98)), HELD_OUT_RESULT_KEYS[i % len(HELD_OUT_RESULT_KEYS)]
        body = {case["parameter"]: case["value"], key: int(result)} if i % 2 else {key: int(result)}
        messages = case["messages"] + call_and_result(f"call_{i:08x}", case["name"],
                                                      {case["parameter"]: case["value"]}, body)
        cases.append({"messages": messages, "tools": case["tools"], "result": result})
    return cases


def answers_with_result(text: str, case: dict) -> bool:
    """An answer, not another call, that gives the tool's result."""
    answer = text.split("</think>")[-1]
    return "<tool_call>" not in answer and re.search(rf"(?<!\d){case['result']}(?!\d)", answer) is not None


_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def call_bodies(text: str) -> list[str]:
    """The JSON text of each `<tool_call>` block of a reply, after its thought."""
    return _CALL.findall(text.split("</think>")[-1])


def is_right_call(text: str, case: dict) -> bool:
    """A well-formed call (the tool-call parser's format) to the right function, with the value
    from the question as its argument, and nothing else called."""
    calls = call_bodies(text)
    if len(calls) != 1:
        return False
    try:
        obj = json.loads(calls[0])
    except ValueError:
        return False
    args = obj.get("arguments") if isinstance(obj, dict) else None
    return (obj.get("name") == case["name"] and isinstance(args, dict)
            and str(args.get(case["parameter"], "")).strip().lower() == case["value"].lower())
