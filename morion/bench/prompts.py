"""Unique random prompts: every (workload, point, run, request) gets its own ids, seeded by a per-invocation
salt, so no prompt can hit a prefix cached by an earlier run (or by an earlier bench on the same server)."""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from morion.errors import MorionError

if TYPE_CHECKING:
    from morion.text.tokenizer import Tokenizer

# Random ids stay below this even for larger vocabularies: the tail of big vocabularies holds special
# and control tokens (Qwen from 151643, Llama 3 from 128000), which some servers treat differently.
_ID_CEILING = 32000
_ID_FLOOR = 3  # ids 0-2 are bos / eos / pad in many small vocabularies


class PromptFactory:
    def __init__(self, vocab_size: int | None, salt: int | None = None) -> None:
        self.salt = secrets.randbits(63) if salt is None else salt
        ceiling = _ID_CEILING if vocab_size is None else min(vocab_size, _ID_CEILING)
        self.low = _ID_FLOOR if ceiling > 2 * _ID_FLOOR else 0
        self.high = ceiling

    def make(self, key: str, length: int) -> list[int]:
        """`length` ids drawn from a generator seeded by the salt and `key` (one key per request)."""
        rng = random.Random(f"{self.salt}:{key}")
        return [rng.randrange(self.low, self.high) for _ in range(length)]


# ------------------------------------------------------------------------------------------- code edit
# `--workloads spec --speculative ngram` (morion/bench/speculative.py): requests whose answers copy most of
# their prompt, as an editing agent's do. Each is a Python module and an instruction to return it whole
# with one change, built from a generator seeded by CODE_EDIT_SEED and the request's key (not the salt: the
# same flags give the same prompts on every machine, so acceptance is comparable between results).
CODE_EDIT = "code-edit"
CODE_EDIT_SEED = "morion-code-edit-v1"

_NOUNS = (
    "order", "invoice", "packet", "record", "sample", "ticket", "session", "account", "message", "segment",
    "reading", "payment", "request", "window", "bucket", "report", "shipment", "event", "user", "task",
)  # fmt: skip
_VERBS = (
    "load", "parse", "merge", "filter", "count", "group", "score", "clean", "split", "rank", "collect",
    "resolve", "format", "check", "expand", "reduce",
)  # fmt: skip
_NEW_WORDS = ("fetch", "build", "gather", "compute", "prepare", "select", "summarize", "normalize")

_FUNCTIONS = (
    '''def {f}({n}s, limit={a}):
    """Return at most `limit` {n}s that are not empty."""
    result = []
    for {n} in {n}s:
        if not {n}:
            continue
        result.append({n})
        if len(result) >= limit:
            break
    return result
''',
    '''def {f}({n}s):
    """Count the {n}s by their kind."""
    counts = {{}}
    for {n} in {n}s:
        kind = {n}.get("kind", "unknown")
        counts[kind] = counts.get(kind, 0) + 1
    print("counted", len({n}s), "{n}s")
    return counts
''',
    '''def {f}(path, encoding="utf-8"):
    """Read one {n} per line from `path`, skipping comments."""
    {n}s = []
    with open(path, encoding=encoding) as handle:
        for line in handle:
            line = line.strip()
            if line and not line.startswith("#"):
                {n}s.append(line)
    return {n}s
''',
    '''def {f}({n}, scale={b}):
    """Scale the numeric fields of one {n}."""
    scaled = dict({n})
    for key, value in {n}.items():
        if isinstance(value, (int, float)):
            scaled[key] = value * scale
    return scaled
''',
    '''def {f}({n}s, key="{k}"):
    """Group the {n}s by `key`."""
    groups = {{}}
    for {n} in {n}s:
        groups.setdefault({n}[key], []).append({n})
    for name, members in sorted(groups.items()):
        print(name, len(members))
    return groups
''',
    '''def {f}(left, right):
    """Merge two {n} lists, keeping the newer {n} of each id."""
    merged = {{{n}["id"]: {n} for {n} in left}}
    for {n} in right:
        old = merged.get({n}["id"])
        if old is None or old["updated"] < {n}["updated"]:
            merged[{n}["id"]] = {n}
    return list(merged.values())
''',
)
_INSTRUCTIONS = {
    "rename": "Rename the function `{old}` to `{new}`, and change every call to it.",
    "constant": "Change the value of `{const}` from {old} to {new}.",
    "type-hints": "Add type hints to the parameters and return value of every function.",
    "logging": "Replace every `print(...)` call with `logger.info(...)`, and add `import logging` and "
    "`logger = logging.getLogger(__name__)` below the imports.",
}
_REPLY = "Reply with the complete updated file in one ```python block, and change nothing else."


@dataclass(frozen=True)
class CodeEditPrompt:
    token_ids: list[int]
    task: str  # a key of _INSTRUCTIONS
    instruction: str
    functions: int
    text: str  # the user message


class CodeEditPrompts:
    """Code-edit requests for a model's tokenizer: the user message through the chat template when the
    tokenizer has one (`chat` True), else the plain text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat = tokenizer.chat_template is not None

    def encode(self, text: str) -> list[int]:
        if self.chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(text)

    def make(self, key: str, budget: int) -> CodeEditPrompt:
        """The longest prompt of at most `budget` tokens (functions added one by one) for request `key`."""
        rng = random.Random(f"{CODE_EDIT_SEED}:{key}")
        noun = rng.choice(_NOUNS)
        constant, value = f"MAX_{noun.upper()}", rng.randrange(8, 512)
        header = (
            f'"""Helpers for {noun} data."""\n\nimport json\nimport os\n\n{constant} = {value}\n'
            f'DEFAULT_NAME = "{noun}"\nRETRY_LIMIT = {rng.randrange(2, 30)}\n'
        )
        names = [f"{verb}_{n}s" for verb in rng.sample(_VERBS, len(_VERBS)) for n in rng.sample(_NOUNS, 2)]
        functions = [
            rng.choice(_FUNCTIONS).format(
                f=name, n=name.split("_", 1)[1][:-1], a=rng.randrange(5, 100), b=rng.randrange(2, 9),
                k=rng.choice(("kind", "owner", "status", "region")),
            )
            for name in names
        ]  # fmt: skip
        # The first function is called at the end, so a rename has a call to change.
        main = f'\n\nif __name__ == "__main__":\n    print({names[0]}(json.loads(os.environ["DATA"])))\n'
        task = rng.choice(sorted(_INSTRUCTIONS))
        renamed = f"{rng.choice(_NEW_WORDS)}_{names[0].split('_', 1)[1]}"
        instruction = _INSTRUCTIONS[task].format(
            old=names[0] if task == "rename" else value,
            new=renamed if task == "rename" else 2 * value,
            const=constant,
        )
        best: CodeEditPrompt | None = None
        for count in range(1, len(functions) + 1):
            source = header + "\n\n" + "\n\n".join(functions[:count]) + main
            text = f"{instruction} {_REPLY}\n\n```python\n{source}```"
            ids = self.encode(text)
            if len(ids) > budget:
                break
            best = CodeEditPrompt(ids, task, instruction, count, text)
        if best is None:
            raise MorionError(
                f"a {CODE_EDIT} prompt needs more than {budget} tokens (one function): raise --contexts"
            )
        return best
