import pytest

from dsv4.tiny import build_tokenizer, tokenizer_config


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """tokenizer.json and tokenizer_config.json of the tiny checkpoint, without its weights."""
    import json

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return path
