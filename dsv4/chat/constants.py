"""The literal strings of the DeepSeek-V4 chat format, read from ``chat_constants.json`` beside
this file (a copy of the official encoder's constants, with their provenance)."""

import json
from pathlib import Path

FORMAT = json.loads(Path(__file__).with_name("chat_constants.json").read_text(encoding="utf-8"))

BOS = FORMAT["bos_token"]
EOS = FORMAT["eos_token"]
THINK_START = FORMAT["thinking_start_token"]
THINK_END = FORMAT["thinking_end_token"]
DSML = FORMAT["dsml_token"]


def to_json(value):
    # The official encoder serialises with Python's json.dumps defaults (", ", ": ",
    # float repr) and keeps non-ASCII raw; the model was trained on exactly that text.
    return json.dumps(value, ensure_ascii=False)
