"""A task made of a data file and reward functions: train on your own prompts without writing a Task class.

Run-file form (one ``[task]`` section, read alike by the trainer, the rollout and the judge)::

    [task]
    name = "dataset"
    options = { path = "data/train.jsonl", answer_field = "answer", reward = "exact_match" }

**Data.** ``path`` is a JSON Lines (``.jsonl``), JSON array (``.json``), CSV or Parquet file, or a directory
written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` with ``split``). Each row has
a prompt (``prompt_field``: a string, or a list of ``{"role", "content"}`` chat messages; or
``messages_field``) and, if ``answer_field`` is set, an answer. A row that is not an object, lacks a
field, holds the wrong type, has a prompt that is empty or only whitespace, or (JSON Lines, CSV) is not
UTF-8 is skipped, counted (:attr:`DatasetTask.skipped`, by reason in :attr:`DatasetTask.skipped_reasons`)
and logged with its row number (1-based, data rows; the first 20, then a summary of every reason with its
count); a file that cannot be read or has no usable row stops start-up with a :class:`DatasetError`
naming the option and the path.

**Order.** Eval rows are held out first: ``eval_split`` (a split of the same ``DatasetDict``) or
``eval_path`` (another file), else ``eval_fraction`` of the rows chosen with ``eval_seed``. The training
stream goes over the rest epoch after epoch, each epoch in an order drawn from ``(seed, epoch)`` when
``shuffle`` (else file order), so prompt ``k`` is a function of ``(seed, k)``: the same whether the stream
started at 0 or at ``k`` (a resumed trainer continues exactly).

**Rewards.** ``reward`` names reward functions (see :mod:`services.tasks.rewards`; a list, or one string
with commas), ``reward_weights`` their weights (default 1 each); the reward is their weighted mean. The
row's other columns travel with the prompt (in its metadata, JSON-encoded) to the judge, which calls
each function as ``fn(prompt_text, completion, **columns, answer=...)``. The trainer names its reward
spec in every prompt, and a judge whose options name different functions fails those samples with both
specs in the reason instead of silently scoring something else.

Files and reward modules load on first use (the trainer at start-up, the judge's user-code workers on
their first call), so a rollout or a judge's own process never reads the data or imports user code.
"""

from __future__ import annotations

import csv
import inspect
import json
import logging
import random
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

from services.runtime.config import ConfigError
from services.tasks.base import Prompt, Reward, encode_chat, encode_text, register_task
from services.tasks.rewards import RewardFn, RewardSpecError, resolve_reward

log = logging.getLogger("rlbus.tasks.dataset")

FORMATS = ("auto", "jsonl", "json", "csv", "parquet", "arrow")
#: bad rows logged one by one before the rest are only counted
LOGGED_BAD_ROWS = 20


class DatasetError(ConfigError):
    """The dataset task's options or data are unusable (the message names the option and the path).

    A :class:`ConfigError`: retrying cannot help, the run file must change."""


def _list(value: Any, key: str) -> list[str]:
    """A list option: a TOML array, or one string with commas (the older form, still read)."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]  # a single weight written as a number
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value]
    raise DatasetError(f"task.options.{key}: expected a list or a comma-separated string, got {value!r}")


# --- reading rows ----------------------------------------------------------------------------------------


class _BadRow(Exception):
    pass


def _reason_kind(reason: str) -> str:
    """A bad row's reason without its details (``not JSON (Expecting value: ...)`` -> ``not JSON``), so the
    skipped rows can be summarised by reason."""
    return reason.split(" (", 1)[0].split(", got ", 1)[0]


def _detect_format(path: Path) -> str:
    if path.is_dir():
        return "arrow"
    suffix = path.suffix.lower()
    formats = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet",
               ".pq": "parquet"}
    if suffix not in formats:
        raise DatasetError(f"task.options.path: cannot tell the format of {str(path)!r} from its suffix; set "
                           f"task.options.format to one of {', '.join(FORMATS[1:])}")
    return formats[suffix]


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DatasetError(f"reading {what} needs the 'pyarrow' package: pip install 'rlbus[data]' "
                           "(or pip install pyarrow)") from None
    return pyarrow


def _arrow_files(path: Path, split: str) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory (a Dataset, or one split of a DatasetDict)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DatasetError(f"task.options.split: {split!r} is not a split of {str(path)!r} "
                               f"(it has {', '.join(splits) or 'none'})")
        path = path / split
    state = path / "state.json"
    if not state.is_file():
        raise DatasetError(f"task.options.path: {str(path)!r} is a directory but not one written by "
                           "datasets' save_to_disk (no state.json or dataset_dict.json)")
    files = [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    if not files:
        raise DatasetError(f"task.options.path: {str(path)!r} lists no data files in state.json")
    return files


def read_rows(path: Path, fmt: str = "auto", split: str = "train") -> Iterator[tuple[int, Any]]:
    """``(row number, row)`` for every data row of ``path``, numbered from 1; an undecodable row is yielded
    as a ``_BadRow`` carrying the reason (so it can be counted), an unreadable file raises OSError/DatasetError."""
    fmt = _detect_format(path) if fmt == "auto" else fmt
    if fmt == "jsonl":
        with path.open("rb") as f:  # decoded line by line: one line that is not UTF-8 is one bad row
            number = 0
            for raw in f:
                if not raw.strip():
                    continue
                number += 1
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield number, _BadRow(f"not UTF-8 ({e.reason} at byte {e.start})")
                    continue
                try:
                    yield number, json.loads(line)
                except ValueError as e:
                    yield number, _BadRow(f"not JSON ({e})")
    elif fmt == "json":
        rows = json.loads(path.read_text(encoding="utf-8", errors="surrogateescape"))
        if not isinstance(rows, list):
            raise DatasetError(f"task.options.path: {str(path)!r} holds a JSON {type(rows).__name__}, "
                               "not an array of rows (use JSON Lines for one object per line)")
        for number, row in enumerate(rows, start=1):
            yield number, _BadRow("not UTF-8 (invalid bytes in the row)") if _undecoded(row) else row
    elif fmt == "csv":
        # bytes that are not UTF-8 become lone surrogates, so the row holding them is found and skipped
        with path.open(encoding="utf-8", errors="surrogateescape", newline="") as f:
            for number, row in enumerate(csv.DictReader(f), start=1):
                if None in row or None in row.values():
                    yield number, _BadRow("wrong number of columns")
                elif _undecoded(row):
                    yield number, _BadRow("not UTF-8 (invalid bytes in the row)")
                else:
                    yield number, row
    elif fmt == "parquet":
        pa = _pyarrow("Parquet files")
        yield from enumerate(pa.parquet.read_table(path).to_pylist(), start=1)
    elif fmt == "arrow":
        pa = _pyarrow("save_to_disk directories")
        number = 0
        for file in _arrow_files(path, split):
            with pa.memory_map(str(file)) as source:
                for row in pa.ipc.open_stream(source).read_all().to_pylist():
                    number += 1
                    yield number, row
    else:
        raise DatasetError(f"task.options.format: {fmt!r} is not one of {', '.join(FORMATS)}")


def _undecoded(value: Any) -> bool:
    """Whether ``value`` (a row: strings in lists and dicts) holds bytes that did not decode as UTF-8
    (``surrogateescape``'s lone surrogates)."""
    if isinstance(value, str):
        return any("\udc80" <= ch <= "\udcff" for ch in value)
    if isinstance(value, dict):
        return any(_undecoded(k) or _undecoded(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_undecoded(v) for v in value)
    return False


# --- the task --------------------------------------------------------------------------------------------


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _BadRow("messages must be a non-empty list")
    out = []
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise _BadRow("each message must be an object with string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


@register_task("dataset")
class DatasetTask:
    """Prompts from a data file, scored by reward functions named in the run file (see the module docstring).

    Args:
        path: the data (file or ``save_to_disk`` directory); needed to train, not to score.
        format: ``auto`` (from the suffix), ``jsonl``, ``json``, ``csv``, ``parquet`` or ``arrow``.
        split: the split of a ``DatasetDict`` directory to train on.
        eval_split: a split of the same ``DatasetDict`` to evaluate on (instead of a held-out fraction).
        eval_path: a separate file to evaluate on (same fields and format).
        eval_fraction: share of the rows held out for evaluation when neither of the above is set.
        eval_seed: seed of the held-out choice.
        prompt_field: the column with the prompt: a string, or a list of chat messages.
        messages_field: a column with chat messages (takes precedence over ``prompt_field``).
        answer_field: the column with the expected answer (``""``: none).
        system_prompt: a system message put before chat prompts (prepended as text to plain prompts).
        max_new_tokens: the completion budget.
        stop: stop strings (a list, or one string).
        shuffle: draw each epoch's order from the seed (else file order).
        reward: reward functions (list, or one comma-separated string); bare names are shipped rewards.
        reward_weights: one weight per reward function (default 1 each).
    """

    name = "dataset"

    def __init__(self, path: str = "", format: str = "auto", split: str = "train", eval_split: str = "",
                 eval_path: str = "", eval_fraction: float = 0.1, eval_seed: int = 20261202,
                 prompt_field: str = "prompt", messages_field: str = "", answer_field: str = "answer",
                 system_prompt: str = "", max_new_tokens: int = 64, stop: str | list[str] = "",
                 shuffle: bool = True, reward: str | list[str] = "exact_match",
                 reward_weights: str | float | list[float] = "", **unknown: Any) -> None:
        if unknown:
            known = [k for k, p in inspect.signature(DatasetTask).parameters.items() if p.kind is p.KEYWORD_ONLY
                     or p.kind is p.POSITIONAL_OR_KEYWORD]
            raise DatasetError(f"task.options.{sorted(unknown)[0]}: unknown option of the dataset task "
                               f"(known: {', '.join(known)})")
        if format not in FORMATS:
            raise DatasetError(f"task.options.format: {format!r} is not one of {', '.join(FORMATS)}")
        if not 0.0 <= eval_fraction < 1.0:
            raise DatasetError(f"task.options.eval_fraction: must be in [0, 1), got {eval_fraction}")
        if max_new_tokens < 1:
            raise DatasetError(f"task.options.max_new_tokens: must be at least 1, got {max_new_tokens}")
        if not (prompt_field or messages_field):
            raise DatasetError("task.options.prompt_field: set it (or messages_field) to the prompt's column")
        self.path, self.format, self.split = path, format, split
        self.eval_split, self.eval_path, self.eval_fraction, self.eval_seed = eval_split, eval_path, eval_fraction, eval_seed
        self.prompt_field, self.messages_field, self.answer_field = prompt_field, messages_field, answer_field
        self.system_prompt = system_prompt
        self.max_new_tokens = max_new_tokens
        self.stop = ([stop] if stop else []) if isinstance(stop, str) else [str(s) for s in stop]
        self.shuffle = shuffle
        self.reward_names = _list(reward, "reward")
        if not self.reward_names:
            raise DatasetError("task.options.reward: name at least one reward function")
        weights = _list(reward_weights, "reward_weights") if reward_weights != "" else []
        try:
            self.reward_weights = [float(w) for w in weights] or [1.0] * len(self.reward_names)
        except ValueError:
            raise DatasetError(f"task.options.reward_weights: {reward_weights!r} are not numbers") from None
        if len(self.reward_weights) != len(self.reward_names):
            raise DatasetError(f"task.options.reward_weights: {len(self.reward_weights)} weights for "
                               f"{len(self.reward_names)} reward functions ({', '.join(self.reward_names)})")
        if any(w < 0 for w in self.reward_weights) or sum(self.reward_weights) <= 0:
            raise DatasetError("task.options.reward_weights: weights must be >= 0 with a positive sum")
        #: the reward spec as the trainer writes it into every prompt (the judge checks it against its own)
        self.reward_spec = ", ".join(f"{n}*{w:g}" for n, w in zip(self.reward_names, self.reward_weights, strict=True))
        #: rows skipped as unusable, by file (train and eval files alike)
        self.skipped = 0
        #: the same rows by reason (the reason without its details, e.g. ``not JSON``): the log's summary
        self.skipped_reasons: dict[str, int] = {}

    def metrics(self) -> dict[str, float]:
        """``task/skipped_rows``: rows skipped as unusable so far (:class:`~services.tasks.base.TaskMetrics`)."""
        return {"task/skipped_rows": float(self.skipped)}

    # --- data ---

    def _load(self, path_text: str, key: str, split: str) -> list[tuple[int, Prompt]]:
        if not path_text:
            raise DatasetError(f"task.options.{key}: the dataset task needs the path of its data to train")
        path = Path(path_text).expanduser()
        prompts: list[tuple[int, Prompt]] = []
        bad = 0
        reasons: dict[str, int] = {}
        try:
            for number, row in read_rows(path, self.format, split):
                try:
                    prompts.append((number, self._row_prompt(row)))
                except _BadRow as e:
                    bad += 1
                    reasons[_reason_kind(str(e))] = reasons.get(_reason_kind(str(e)), 0) + 1
                    if bad <= LOGGED_BAD_ROWS:
                        log.warning("%s: row %d skipped: %s", path, number, e)
        except DatasetError:
            raise
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise DatasetError(f"task.options.{key}: cannot read {str(path)!r}: {e}") from e
        except Exception as e:  # pyarrow's errors (ArrowInvalid, ...) share no base class with the above
            raise DatasetError(f"task.options.{key}: cannot read {str(path)!r}: {type(e).__name__}: {e}") from e
        self.skipped += bad
        for kind, n in reasons.items():
            self.skipped_reasons[kind] = self.skipped_reasons.get(kind, 0) + n
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
        if bad:
            log.warning("%s: %d of %d rows skipped as unusable, by reason: %s%s", path, bad, bad + len(prompts),
                        summary, f" (the first {LOGGED_BAD_ROWS} logged above)" if bad > LOGGED_BAD_ROWS else "")
        if not prompts:
            raise DatasetError(f"task.options.{key}: {str(path)!r} has no usable rows"
                               + (f" ({bad} skipped: {summary})" if bad else " (it is empty)"))
        return prompts

    def _row_prompt(self, row: Any) -> Prompt:
        """A row as a prompt (without its id yet), or _BadRow saying what is wrong with it."""
        if isinstance(row, _BadRow):
            raise row
        if not isinstance(row, dict):
            raise _BadRow(f"a row must be an object, got {type(row).__name__}")
        field = self.messages_field or self.prompt_field
        if field not in row:
            raise _BadRow(f"missing field {field!r}")
        value = row[field]
        text, messages = "", None
        if isinstance(value, str) and not self.messages_field:
            if not value.strip():
                raise _BadRow(f"field {field!r} is empty or only whitespace")
            text = value
        elif isinstance(value, list):
            messages = _messages(value)
            if self.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            users = [m["content"] for m in messages if m["role"] == "user"]
            text = users[-1] if users else messages[-1]["content"]
            if not text.strip():
                raise _BadRow(f"field {field!r} is empty or only whitespace (its last user message)")
        else:
            raise _BadRow(f"field {field!r} must be a string or a list of chat messages, got {type(value).__name__}")
        metadata = {"reward": self.reward_spec}
        if self.answer_field:
            if self.answer_field not in row:
                raise _BadRow(f"missing field {self.answer_field!r}")
            answer = row[self.answer_field]
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise _BadRow(f"field {self.answer_field!r} must be a string or a number, got {type(answer).__name__}")
            metadata["answer"] = str(answer)
        columns = {k: v for k, v in row.items() if k not in (self.prompt_field, self.messages_field)}
        try:
            metadata["fields"] = json.dumps(columns, default=str)
        except (TypeError, ValueError) as e:
            raise _BadRow(f"its columns cannot be sent to the judge as JSON: {e}") from None
        return Prompt(id="", text=text, messages=messages, metadata=metadata)

    @cached_property
    def _split(self) -> tuple[list[tuple[int, Prompt]], list[tuple[int, Prompt]]]:
        """(train rows, eval rows), each as (row number, prompt without id)."""
        _ = self.rewards  # a reward path that does not import stops the trainer at start-up, not at the judge
        rows = self._load(self.path, "path", self.split)
        if self.eval_split:
            return rows, self._load(self.path, "eval_split", self.eval_split)
        if self.eval_path:
            return rows, self._load(self.eval_path, "eval_path", self.split)
        held = int(len(rows) * self.eval_fraction)
        if self.eval_fraction > 0 and held == 0 and len(rows) >= 2:
            held = 1
        order = list(range(len(rows)))
        random.Random(f"dataset-eval:{self.eval_seed}").shuffle(order)
        chosen = set(order[:held])
        return [r for i, r in enumerate(rows) if i not in chosen], [rows[i] for i in sorted(chosen)]

    def _epoch_order(self, seed: int, epoch: int, n: int) -> list[int]:
        order = list(range(n))
        if self.shuffle:
            random.Random(f"dataset-train:{seed}:{epoch}").shuffle(order)
        return order

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless: epoch after epoch over the training rows; prompt id ``dataset/train/<seed>/<position>``,
        the source row number in ``metadata["row"]``."""
        rows = self._split[0]
        n = len(rows)
        position = start
        epoch, order = -1, []
        while True:
            if position // n != epoch:
                epoch = position // n
                order = self._epoch_order(seed, epoch, n)
            number, prompt = rows[order[position % n]]
            yield self._with_id(prompt, f"dataset/train/{seed}/{position}", number)
            position += 1

    def eval_prompts(self) -> list[Prompt]:
        """The held-out rows in file order; prompt id ``dataset/eval/<k>``."""
        return [self._with_id(p, f"dataset/eval/{k}", number) for k, (number, p) in enumerate(self._split[1])]

    @staticmethod
    def _with_id(prompt: Prompt, prompt_id: str, number: int) -> Prompt:
        return Prompt(id=prompt_id, text=prompt.text, messages=prompt.messages,
                      metadata={**prompt.metadata, "row": str(number)})

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """Chat prompts through the tokenizer's chat template (contents joined by blank lines when it has
        none); plain prompts as text after BOS, behind the system prompt if one is set."""
        if prompt.messages:
            if getattr(tokenizer, "chat_template", None):
                return encode_chat(tokenizer, prompt.messages)
            return encode_text(tokenizer, "\n\n".join(m["content"] for m in prompt.messages) + "\n\n")
        return encode_text(tokenizer, self.system_prompt + prompt.text)

    # --- reward ---

    @cached_property
    def rewards(self) -> list[tuple[str, RewardFn, float]]:
        """The reward functions, imported on first use (:class:`DatasetError` naming the spec if one fails)."""
        try:
            return [(name, resolve_reward(name), w) for name, w in zip(self.reward_names, self.reward_weights,
                                                                          strict=True)]
        except RewardSpecError as e:
            raise DatasetError(f"task.options.reward: {e}") from e

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """The weighted mean of the reward functions, each called with the row's columns.

        Raises ValueError when the prompt was made under another reward spec or a function returns
        something that is not a number in [0, 1] (the judge scores the sample failed, with the reason)."""
        sent = prompt.metadata.get("reward")
        if sent is not None and sent != self.reward_spec:
            raise ValueError(f"the trainer scores this task with [{sent}] but this judge's [task.options] name "
                             f"[{self.reward_spec}]: run the judge with the trainer's run file (one [task] section)")
        fields: dict[str, Any] = json.loads(prompt.metadata.get("fields", "{}"))
        if "answer" in prompt.metadata:
            fields["answer"] = prompt.metadata["answer"]
        total, parts = 0.0, []
        for name, fn, weight in self.rewards:
            r = fn(prompt.text, completion, **fields)
            value = r.value if isinstance(r, Reward) else r
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"reward {name} returned {value!r}, not a number in [0, 1]")
            total += weight * float(value)
            parts.append(f"{name}={float(value):g}" + (f" ({r.explanation})" if isinstance(r, Reward) and r.explanation else ""))
        return Reward(total / sum(self.reward_weights), "; ".join(parts))
