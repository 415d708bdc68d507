"""Prompts of a jsonl file: the first turn of each Spec-Bench-style question (benchmarks), or a ``prompt`` field
(the training prompts of draft distillation)."""

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


def _first_turn(obj: Any) -> str | None:
    """The ``prompt`` of a record, else the first of its ``turns``; None when neither is a non-empty string."""
    if not isinstance(obj, dict):
        return None
    prompt = obj.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return prompt
    turns = obj.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
        return turns[0]
    return None


def load_prompts(path: str | os.PathLike, limit: int | None = None) -> list[BenchPrompt]:
    """Questions of a Spec-Bench-style jsonl (question_id, category, turns): the FIRST turn of each; a line with
    a ``prompt`` field instead (the training prompts of ``specdec draft distill``) is a question of that text.

    With ``limit``, N questions are taken round-robin across categories (categories in order of first
    appearance, questions in file order within a category), so a small limit still covers every category.

    Raises:
        FileNotFoundError: no such file.
        InvalidRequestError: a line is not JSON or has neither a non-empty ``prompt`` nor a non-empty first turn;
            limit < 1; no questions.
    """
    from specdec_runtime.common.errors import InvalidRequestError

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
            text = _first_turn(obj)
            if text is None:
                raise InvalidRequestError(f"{path}:{lineno}: no non-empty 'prompt' or first turn in 'turns'")
            questions.append(
                BenchPrompt(obj.get("question_id", lineno), str(obj.get("category") or "uncategorized"), text)
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
