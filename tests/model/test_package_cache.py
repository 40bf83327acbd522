"""The compiled packages' cache stays bounded (dsv4/model/package_cache.py)."""

import os

from dsv4.model import package_cache


def _key(i: int) -> str:
    return f"{i:016x}"


def _packages(cache, key: str, used: float, pieces=("mix", "project_inputs_many")) -> list:
    paths = []
    for piece in pieces:
        path = cache / f"{piece}-{key}.pt2"
        path.write_bytes(b"package")
        os.utime(path, (used, used))
        paths.append(path)
    return paths


def test_prune_keeps_the_most_recently_used_keys(tmp_path):
    keys = {_key(i): 1_000_000 + 1000 * i for i in range(5)}  # _key(4) used last
    files = {key: _packages(tmp_path, key, used) for key, used in keys.items()}
    other = [tmp_path / "notes.txt", tmp_path / f"mix-{_key(0)}.1234.partial.pt2", tmp_path / "mix-short.pt2"]
    for path in other:
        path.write_bytes(b"x")
        os.utime(path, (1, 1))
    # one package of the oldest key used again since: the key is as recent as its latest package
    os.utime(files[_key(0)][0], (2_000_000, 2_000_000))

    removed = package_cache.prune(tmp_path, keep=3)

    assert sorted(removed) == sorted(files[_key(1)] + files[_key(2)])
    for key in (_key(0), _key(3), _key(4)):
        assert all(path.exists() for path in files[key])
    assert all(path.exists() for path in other)  # only whole packages are ever removed
    assert package_cache.prune(tmp_path, keep=3) == []


def test_mark_used_makes_a_key_the_most_recent(tmp_path):
    old = _packages(tmp_path, _key(1), 1_000_000)
    newer = [_packages(tmp_path, _key(i), 2_000_000 + i) for i in range(2, 4)]
    package_cache.mark_used(old)
    removed = package_cache.prune(tmp_path, keep=2)
    assert sorted(removed) == sorted(newer[0])
    assert all(path.exists() for path in old + newer[1])
