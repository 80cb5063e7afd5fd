"""Which ids a draft vocabulary keeps (docs/design.md, The draft vocabulary): the target's own outputs on
training prompts, counted and ranked, and one cut of a drafter folder's head.

A draft vocabulary (models/draft_vocab.py) is only as good as the tokens it holds: an id the target says
that the drafter cannot propose is a draft that is never accepted. So the ids are ranked by how often the
target itself says them in answers it gave to training prompts, read from

    a distillation folder (prune distill): the records' response_ids, their prompts' text checked
    a --save-outputs file (prune bench): the ar lines' output_ids, their prompts' ids checked

and never from a suite's calib or eval part: those prompts choose and judge the drafter's steps, and a
vocabulary counted on their answers would read better there than anywhere else. A source holding any of
those prompts (by text, as distillation data is filtered when it is made, or by suite id) is refused.
Ids are ranked by count, ties by id; proposable ids never seen rank after them in id order.
"""

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from models.errors import DataError

OUTPUTS_DECODER = "ar"  # the lines of a --save-outputs file that hold the target's own answers


@dataclass
class TokenRanking:
    """Token ids ranked by how often the target said them.

    Attributes:
        ids: int64 `(N,)`, the proposable ids seen, most frequent first (ties by id).
        counts: int64 `(N,)`, how often each was said.
        source: what was counted, one entry per folder or file ("data/demo-distill", ...).
        tokens: every counted token (the proposable ones).
    """

    ids: torch.Tensor
    counts: torch.Tensor
    source: list[str]
    tokens: int

    @property
    def sha256(self) -> str:
        """A digest of the ranking (ids and counts): what a run records and a resume must meet again."""
        digest = hashlib.sha256(self.ids.numpy().tobytes())
        digest.update(self.counts.numpy().tobytes())
        return digest.hexdigest()

    def coverage(self, ids: torch.Tensor) -> float:
        """The share of the counted tokens that `ids` hold."""
        if not self.tokens:
            return 0.0
        held = torch.isin(self.ids, ids.to("cpu", torch.int64))
        return float(self.counts[held].sum()) / self.tokens

    def describe(self) -> str:
        """The source as a draft vocabulary's config records it: each folder's or file's name."""
        return ", ".join(Path(source).name for source in self.source)

    def record(self) -> dict:
        """What a run's state and a cut's report keep of it."""
        return {"source": self.source, "tokens": self.tokens, "distinct": int(self.ids.numel()),
                "sha256": self.sha256}


def _folder_answers(path: Path) -> list[tuple[str | None, str | None, list[int]]]:
    """(prompt text, prompt id, the target's answer ids) of each record of a distillation folder."""
    from models.provenance import record_text

    from .training.data import load_distillation_data

    return [(record_text(r), None, list(r.get("response_ids") or [])) for r in load_distillation_data(path, True)]


def _outputs_answers(path: Path) -> list[tuple[str | None, str | None, list[int]]]:
    """(None, prompt id, the target's answer ids) of each ar line of a --save-outputs file."""
    from decode.prompts import read_jsonl

    answers = []
    try:
        for _, line in read_jsonl(path):
            if line.get("decoder") == OUTPUTS_DECODER:
                answers.append((None, str(line["id"]), [int(t) for t in line["output_ids"]]))
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"cannot read {path} ({exc}); pass a file written by prune bench --save-outputs") from None
    if not answers:
        raise DataError(f"{path} has no {OUTPUTS_DECODER} lines; record the target's outputs with prune bench "
                        f"--decoder {OUTPUTS_DECODER} --save-outputs FILE on training prompts")
    return answers


# What a draft vocabulary may be counted from: a folder of distillation data or a --save-outputs file.
READERS = {"folder": _folder_answers, "outputs": _outputs_answers}


def _kind(path: Path) -> str:
    return "folder" if path.is_dir() else "outputs"


def held_out_prompts() -> tuple[set[str], set[str]]:
    """(texts, ids) of every prompt of the built-in suites' calib and eval parts (every turn), of the suites
    whose data is here (nothing is downloaded for the check; a suite that is not here is named in a warning)."""
    from decode.suites import HELD_OUT_PARTS, SUITES, load_suite
    from models.errors import D3DError

    texts, ids = set(), set()
    for name in SUITES:
        try:
            records = [record for part in HELD_OUT_PARTS for record in load_suite(f"{name}:{part}", fetch=False)]
        except D3DError as exc:
            print(f"warning: the draft vocabulary's source is not checked against the {name} suite, whose data is "
                  f"not here ({exc})", file=sys.stderr)
            continue
        for record in records:
            ids.add(str(record["id"]))
            texts.update(t.strip() for t in [record.get("prompt") or "", *(record.get("turns") or [])] if t.strip())
    return texts, ids


def check_not_held_out(answers, where: str, held_out: tuple[set[str], set[str]] | None) -> None:
    """DataError when an answer of `answers` (from `where`) is to a held-out prompt: its text holds or equals a
    held-out prompt's text, or its id is a held-out prompt's id."""
    if held_out is None:
        return
    texts, ids = held_out
    for text, prompt_id, _ in answers:
        found = prompt_id in ids if prompt_id is not None else any(t in text for t in texts if text)
        if found:
            shown = prompt_id or (text.strip().splitlines() or [""])[0][:60]
            raise DataError(f"{where} holds an answer to a calib or eval prompt of the built-in suites ({shown!r}); "
                            "count the draft vocabulary on training prompts only (prune distill data, or prune "
                            "bench --save-outputs on a train part), never on the prompts that choose and judge "
                            "the drafter")


def rank_tokens(sources: list[str], config, held_out: tuple[set[str], set[str]] | None = None,
                check: bool = True) -> TokenRanking:
    """Rank the ids a drafter with `config` may propose by how often the target says them in `sources`
    (distillation folders and --save-outputs files; see the module docstring).

    `held_out`: the held-out prompts to refuse (texts, ids); None reads them from the built-in suites
    (`held_out_prompts`), unless `check` is False."""
    if check and held_out is None:
        held_out = held_out_prompts()
    answers = []
    for source in sources:
        path = Path(source)
        read = READERS[_kind(path)](path)
        if check:
            check_not_held_out(read, str(path), held_out)
        answers += [ids for _, _, ids in read]
    return ranking_of(answers, config, [str(s) for s in sources])


def ranking_of(answers: list[list[int]], config, source: list[str]) -> TokenRanking:
    """The TokenRanking of the target's `answers` (token ids each) for a drafter with `config`; `source` names
    where they come from (already checked: see `rank_tokens`)."""
    from models.draft_vocab import proposable_ids

    proposable = proposable_ids(config)
    counts = torch.zeros(int(proposable.max()) + 1, dtype=torch.int64)
    said = torch.tensor([t for ids in answers for t in ids], dtype=torch.int64)
    said = said[(said >= 0) & (said < counts.numel())]
    counts += torch.bincount(said, minlength=counts.numel())
    allowed = torch.zeros_like(counts, dtype=torch.bool)
    allowed[proposable] = True
    counts[~allowed] = 0
    seen = counts.nonzero().flatten()
    order = sorted(seen.tolist(), key=lambda i: (-int(counts[i]), i))
    ids = torch.tensor(order, dtype=torch.int64)
    if not ids.numel():
        raise DataError(f"{', '.join(source)} hold no answer token the drafter can propose; give distillation data "
                        "of this drafter's target")
    return TokenRanking(ids, counts[ids], list(source), int(counts.sum()))


def proposed_now(model) -> int:
    """How many ids `model` proposes from now: its draft vocabulary's, else every proposable id."""
    from models.draft_vocab import draft_vocab, proposable_ids

    ids = draft_vocab(model)
    return int(ids.numel()) if ids is not None else int(proposable_ids(model.config).numel())


def next_head_size(sizes, model) -> int | None:
    """The draft vocabulary size a head step of `model` tries next: the largest of `sizes` below the ids it
    proposes from now (prune.config.RunConfig.vocab_sizes), None when none is."""
    below = [size for size in sizes if size < proposed_now(model)]
    return max(below) if below else None


def cut_drafter(model, ranking: TokenRanking, size: int):
    """A copy of `model` proposing from the `size` best-ranked of the ids it proposes now (`model` unchanged)."""
    from models.draft_vocab import cut_ids, draft_vocab, with_draft_vocab

    ids = cut_ids(draft_vocab(model), ranking.ids, size, model.config)
    return with_draft_vocab(model, ids, ranking.describe(), ranking.coverage(ids))


def vocab_record(model, ranking: TokenRanking | None = None) -> dict | None:
    """What an export's report records of a drafter's draft vocabulary (None without one): its config entry,
    and the ranking it was cut from."""
    named = getattr(model.config, "draft_vocab", None)
    if not named:
        return None
    return {**named, **({"ranking": ranking.record()} if ranking is not None else {})}


def cut_folder(source, destination, size: int, ranking: TokenRanking, overwrite: bool = False) -> dict:
    """Export drafter folder `source` to `destination` proposing from the `size` best-ranked of the ids it
    proposes now (models.draft_vocab.cut_ids), with its pruning history and a "vocab" row; returns the cut's
    record (tokens, coverage, source, ...)."""
    from models.checkpoint import ensure_writable_output
    from models.drafter import load_drafter

    from .export import export_step, read_report, resolve_export_dtype

    ensure_writable_output(destination, overwrite)
    source = Path(source).resolve()
    model = cut_drafter(load_drafter(source), ranking, size)
    coverage = model.config.draft_vocab["coverage"]
    report, history = read_report(source)
    report["exported_from"] = str(source)
    report.setdefault("source", str(source))  # the drafter `prune heal` distils from
    report["draft_vocab"] = vocab_record(model, ranking)
    history = [*history, {"step": "vocab", "head_rows": size, "layers": model.config.num_hidden_layers,
                          "coverage": round(coverage, 6)}]
    export_step(model, destination, source, report, history, dtype=resolve_export_dtype(None, source),
                overwrite=overwrite)
    return {"source": str(source), "destination": str(destination), "tokens": size, "coverage": coverage,
            "ranking": ranking.record()}


def ranking_text(ranking: TokenRanking, sizes) -> str:
    """One line per size: the share of the counted tokens its best-ranked ids hold."""
    lines = [f"{ranking.tokens} answer tokens of {ranking.describe()}, {ranking.ids.numel()} distinct ids"]
    for size in sizes:
        share = float(ranking.counts[:size].sum()) / ranking.tokens if ranking.tokens else 0.0
        lines.append(f"  {size:>6} ids hold {share:.2%}")
    return "\n".join(lines)
