"""Golden token files and the correctness gate every optimization must pass.

A golden (JSON, `FORMAT`) records a prompt's token ids, the greedy continuation, and for each
continuation position i (the one predicting `greedy[i]` from prompt + greedy[:i]) the top-k token
ids and float32 logits, plus the identity of the model that made it (config hash, weight-file
sha256s, dtype, device, source and version).

`check_golden` runs two gates:
- teacher-forced: one forward over prompt + golden continuation; position i passes when our argmax
  is the golden token, or when the golden top logits are a true tie (within `tie_tol`, absolute,
  default 1e-6) and our argmax is one of the tied tokens;
- free-run: our own greedy generation (prefill + KV-cache decode) must reproduce the first
  `free_run` golden tokens exactly.

Goldens come from mlxr (`make_golden`, the CPU float32 reference path by default) or from any
other source through `build_golden` (tests feed it mlx-lm's logits).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MlxrError
from . import trace

FORMAT = "mlxr-golden/1"
DEFAULT_TIE_TOL = 1e-6
DEFAULT_FREE_RUN = 16


# ----------------------------------------------------------------------------- identity

def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def config_hash(model_dir: str | Path) -> str:
    """sha256 of config.json as canonical JSON (sorted keys), so formatting does not matter."""
    with open(Path(model_dir) / "config.json") as f:
        cfg = json.load(f)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def weight_hashes(model_dir: str | Path) -> dict[str, str]:
    """sha256 of every *.safetensors file of a model directory, by file name."""
    d = Path(model_dir)
    return {p.name: _sha256_file(p) for p in sorted(d.glob("*.safetensors"))}


def identity(model_dir: str | Path, dtype: str, device: str, source: str = "mlxr",
             version: str | None = None) -> dict:
    if version is None:
        from .. import __version__ as version
    return {"model": Path(model_dir).name, "config_sha256": config_hash(model_dir),
            "weights_sha256": weight_hashes(model_dir), "dtype": dtype, "device": device,
            "source": source, "version": version}


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


# ----------------------------------------------------------------------------- writing

def build_golden(prompt: Sequence[int], greedy: Sequence[int], logits, ident: dict,
                 top_k: int = 10) -> dict:
    """A golden from teacher-forced float32 logits [len(prompt)+len(greedy) (or -1), V] over
    prompt + greedy. Row len(prompt)-1+i predicts greedy[i]."""
    prompt, greedy = [int(t) for t in prompt], [int(t) for t in greedy]
    logits = np.asarray(logits, dtype=np.float32)
    n0 = len(prompt) - 1
    if logits.ndim != 2 or logits.shape[0] < n0 + len(greedy):
        raise MlxrError(f"logits of shape {logits.shape} do not cover prompt + continuation")
    rows = logits[n0:n0 + len(greedy)]
    k = min(top_k, rows.shape[1])
    # Stable sort: among equal logits the lower id comes first (like torch/numpy argmax).
    order = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
    vals = np.take_along_axis(rows, order, axis=-1)
    positions = [{"token": g, "top_ids": [int(t) for t in o], "top_logits": [float(v) for v in w]}
                 for g, o, w in zip(greedy, order, vals)]
    return {"format": FORMAT, "identity": ident, "prompt_ids": prompt, "greedy": greedy,
            "top_k": k, "positions": positions}


def make_golden(model, prompt_ids: Sequence[int], tokens: int = 32, top_k: int = 10) -> dict:
    """A golden from an mlxr model: greedy continuation (EOS ignored), then teacher-forced
    logits."""
    prompt_ids = [int(t) for t in prompt_ids]
    greedy = list(model.generate(prompt_ids, max_tokens=tokens, temperature=0.0,
                                 ignore_eos=True))
    logits = model.logits(prompt_ids + greedy).numpy()
    ident = identity(model.path, _dtype_name(model.dtype), model.device.type)
    return build_golden(prompt_ids, greedy, logits, ident, top_k)


def save_golden(golden: dict, path: str | Path) -> None:
    # One key (and one position) per line: small diffs, still plain JSON.
    parts = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in golden.items() if k != "positions"]
    rows = ",\n  ".join(json.dumps(p) for p in golden["positions"])
    parts.append(f' "positions": [\n  {rows}\n ]')
    Path(path).write_text("{\n" + ",\n".join(parts) + "\n}\n")


def load_golden(path: str | Path) -> dict:
    try:
        g = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise MlxrError(f"{path}: not a golden file ({e})") from None
    if not isinstance(g, dict) or g.get("format") != FORMAT:
        raise MlxrError(f"{path}: not a golden file (format is not {FORMAT!r})")
    if len(g["positions"]) != len(g["greedy"]):
        raise MlxrError(f"{path}: {len(g['positions'])} positions for {len(g['greedy'])} tokens")
    return g


# ----------------------------------------------------------------------------- checking

@dataclass
class Divergence:
    gate: str  # "teacher-forced" or "free-run"
    position: int  # continuation index
    golden_token: int
    our_token: int
    golden_top: list[tuple[int, float]]
    our_top: list[tuple[int, float]] = field(default_factory=list)

    def describe(self) -> str:
        def fmt(top):
            return "  ".join(f"{i}:{v:.6g}" for i, v in top) or "-"
        return (f"{self.gate} gate: first divergence at continuation position {self.position}: "
                f"golden token {self.golden_token}, ours {self.our_token}\n"
                f"  golden top-5: {fmt(self.golden_top[:5])}\n"
                f"  ours   top-5: {fmt(self.our_top[:5])}")


@dataclass
class CheckResult:
    positions: int
    teacher_failures: list[int]
    ties_accepted: list[int]
    free_run: int  # tokens compared
    free_run_match: int  # length of the matching prefix
    first: Divergence | None  # first teacher-forced divergence, else the free-run one
    free_div: Divergence | None = None

    @property
    def ok(self) -> bool:
        return not self.teacher_failures and self.free_run_match >= self.free_run

    def to_json(self) -> dict:
        d = {"ok": self.ok, "positions": self.positions,
             "teacher_forced_failures": self.teacher_failures,
             "ties_accepted": self.ties_accepted, "free_run": self.free_run,
             "free_run_match": self.free_run_match}
        for key, div in (("first_divergence", self.first), ("free_run_divergence",
                                                               self.free_div)):
            if div is not None:
                d[key] = {"gate": div.gate, "position": div.position,
                          "golden_token": div.golden_token, "our_token": div.our_token,
                          "golden_top5": div.golden_top[:5], "our_top5": div.our_top[:5]}
        return d


def tied_tokens(pos: dict, tie_tol: float) -> list[int]:
    """The golden tokens whose logit is within tie_tol of the golden top logit."""
    top = pos["top_logits"][0]
    return [i for i, v in zip(pos["top_ids"], pos["top_logits"]) if top - v <= tie_tol]


def gate_position(pos: dict, our_token: int, tie_tol: float) -> str:
    """'match', 'tie' (accepted by the tie rule) or 'fail'."""
    if our_token == pos["token"]:
        return "match"
    tied = tied_tokens(pos, tie_tol)
    return "tie" if len(tied) > 1 and pos["token"] in tied and our_token in tied else "fail"


def _top(row: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
    order = np.argsort(-row, kind="stable")[:k]
    return [(int(i), float(row[i])) for i in order]


def gate_logits(golden: dict, logits, tie_tol: float = DEFAULT_TIE_TOL):
    """Teacher-forced gate over our logits [T, V] of prompt + golden greedy.
    Returns (failing positions, tie-accepted positions, first Divergence or None)."""
    logits = np.asarray(logits, dtype=np.float32)
    n0 = len(golden["prompt_ids"]) - 1
    fails, ties, first = [], [], None
    for i, pos in enumerate(golden["positions"]):
        row = logits[n0 + i]
        ours = int(np.argmax(row))
        verdict = gate_position(pos, ours, tie_tol)
        if verdict == "tie":
            ties.append(i)
        elif verdict == "fail":
            fails.append(i)
            if first is None:
                first = Divergence("teacher-forced", i, pos["token"], ours,
                                   list(zip(pos["top_ids"], pos["top_logits"])), _top(row))
    return fails, ties, first


def check_identity(golden: dict, model_dir: str | Path) -> list[str]:
    """Differences between the golden's model identity and a model directory (empty: same)."""
    gi = golden["identity"]
    problems = []
    if gi.get("config_sha256") != config_hash(model_dir):
        problems.append("config.json differs from the golden's model")
    w = weight_hashes(model_dir)
    if gi.get("weights_sha256") and gi["weights_sha256"] != w:
        bad = sorted(set(w) ^ set(gi["weights_sha256"]) |
                     {k for k in w if gi["weights_sha256"].get(k, w[k]) != w[k]})
        problems.append(f"weight files differ from the golden's model: {', '.join(bad)}")
    return problems


def check_golden(model, golden: dict, tie_tol: float = DEFAULT_TIE_TOL,
                 free_run: int | None = DEFAULT_FREE_RUN) -> CheckResult:
    """Run both gates of `golden` on an mlxr model. free_run=None compares every golden token."""
    seq = golden["prompt_ids"] + golden["greedy"]
    # The last golden token is never fed: its position is predicted by the row before it.
    with trace.span("teacher-forced gate"):
        logits = model.logits(seq[:-1] if golden["greedy"] else seq).numpy()
        fails, ties, first = gate_logits(golden, logits, tie_tol)
    n = len(golden["greedy"])
    k = n if free_run is None else max(0, min(int(free_run), n))
    match, free_div = 0, None
    if k:
        with trace.span("free-run gate"):
            ours = list(model.generate(golden["prompt_ids"], max_tokens=k, temperature=0.0,
                                       ignore_eos=True))
        while match < min(k, len(ours)) and ours[match] == golden["greedy"][match]:
            match += 1
        if match < k:
            pos = golden["positions"][match]
            row = logits[len(golden["prompt_ids"]) - 1 + match]
            our_tok = ours[match] if match < len(ours) else -1
            free_div = Divergence("free-run", match, pos["token"], our_tok,
                                  list(zip(pos["top_ids"], pos["top_logits"])), _top(row))
    return CheckResult(n, fails, ties, k, match, first or free_div, free_div)


def read_prompt(model, prompt_file: str | Path | None = None, prompt: str | None = None,
                prompt_ids: str | None = None) -> list[int]:
    """Prompt ids from `--prompt-ids 1,2,3`, `--prompt TEXT` or a prompt file (text, or a JSON
    list of ids / {"prompt_ids": [...]})."""
    if prompt_ids is not None:
        try:
            return [int(t) for t in prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise MlxrError(f"--prompt-ids {prompt_ids!r}: not a list of integers") from None
    if prompt_file is not None:
        text = Path(prompt_file).read_text()
        if str(prompt_file).endswith(".json"):
            data = json.loads(text)
            ids = data.get("prompt_ids") if isinstance(data, dict) else data
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise MlxrError(f"{prompt_file}: expected a JSON list of token ids")
            return ids
        return model.encode_prompt(text)
    if prompt is not None:
        return model.encode_prompt(prompt)
    raise MlxrError("give a prompt: --prompt-file F, --prompt TEXT or --prompt-ids IDS")
