"""Benchmark prompts: the first turn of each question of a Spec-Bench-style jsonl."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchPrompt:
    question_id: Any
    category: str
    prompt: str  # the first user turn


def load_prompts(path: str | os.PathLike, limit: int | None = None) -> list[BenchPrompt]:
    """Questions of a Spec-Bench-style jsonl (question_id, category, turns): the FIRST turn of each.

    With ``limit``, N questions are taken round-robin across categories (categories in order of first
    appearance, questions in file order within a category), so a small limit still covers every category.

    Raises:
        FileNotFoundError: no such file.
        InvalidRequestError: a line is not JSON or lacks a non-empty first turn; limit < 1; no questions.
    """
    from common.errors import InvalidRequestError

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no prompts file at {path}")
    if limit is not None and limit < 1:
        raise InvalidRequestError(f"--limit must be >= 1, got {limit}")
    questions: list[BenchPrompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            turns = obj.get("turns") if isinstance(obj, dict) else None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise InvalidRequestError(f"{path}:{lineno}: no non-empty first turn in 'turns'")
            questions.append(
                BenchPrompt(obj.get("question_id", lineno), str(obj.get("category") or "uncategorized"), turns[0])
            )
    if not questions:
        raise InvalidRequestError(f"{path}: no questions")
    if limit is None or limit >= len(questions):
        return questions
    by_category: dict[str, list[BenchPrompt]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    picked: list[BenchPrompt] = []
    rank = 0
    while len(picked) < limit:
        for items in by_category.values():
            if rank < len(items) and len(picked) < limit:
                picked.append(items[rank])
        rank += 1
    return picked
