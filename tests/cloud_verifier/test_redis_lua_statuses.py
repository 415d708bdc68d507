"""The session store's Lua statuses are named once (cloud_verifier/store/redis_lua.py) and used by name on both
sides: in the scripts' text (``$NAME``, put in at import) and in redis.py, which reads the replies. Bare numbers
made the two drift silently apart; test_store.py runs the scripts themselves against a real Redis."""

from __future__ import annotations

import re
from pathlib import Path

from specdec_runtime.cloud_verifier.store import redis_lua as lua

STORE = Path(lua.__file__).resolve().parent
SCRIPTS = {name: getattr(lua, name) for name in ("CREATE", "APPEND", "EXTEND", "TOUCH", "DELETE", "DISOWN", "CLAIM",
                                                  "GET")}


def test_every_status_is_put_in():
    for name, text in SCRIPTS.items():
        assert "$" not in text, f"{name} keeps an unreplaced status"
    assert f"return {{{lua.NOT_FOUND}, 0}}" in lua.APPEND and f"return {{{lua.GENERATING}, 0}}" in lua.EXTEND


def test_no_bare_status_numbers_on_either_side():
    source = (STORE / "redis_lua.py").read_text()
    assert not re.findall(r"return \{?-?\d", source), "a script returns a bare status number"
    reader = (STORE / "redis.py").read_text()
    assert not re.findall(r"status\)? *[!=]= *-?\d", reader), "redis.py compares a status with a bare number"


def test_each_scripts_statuses_are_distinct():
    commit = [lua.COMMITTED, lua.NOT_FOUND, lua.LENGTH_MISMATCH, lua.NOT_HOLDER, lua.FINISHED, lua.GENERATING]
    other = [lua.DONE, lua.ABSENT, lua.NOT_HOLDER]
    assert len(set(commit)) == len(commit) and len(set(other)) == len(other)
