"""Pooling models: what a checkpoint pools and how, read without torch, and what one
request asks of it.

A pooling engine runs prompts through the model without the LM head and returns, per
request, pooled hidden states (embeddings) or a score head's outputs (classification,
reward, cross-encoder relevance); generate and pool requests never share an engine.
The frontend and the engine resolve the same `Pooler` from the checkpoint folder and
the same `PoolingConfig` flags, as they do `ModelInfo`:

- a `*ForSequenceClassification` architecture classifies: its score head on the last
  token, softmax over several labels or sigmoid for one (or for multi-label problems),
  labels from `id2label`;
- a sentence-transformers folder (`modules.json`) embeds: Transformer, Pooling
  (`1_Pooling/config.json`: cls, mean or lasttoken) and optionally Normalize, with the
  prompts of `config_sentence_transformers.json`; other modules (Dense, ...) are refused;
- a bare decoder (`LlamaModel`, `Qwen3Model`, ...) embeds by its last token, normalized
  (the Qwen3-Embedding layout);
- `--runner pooling` makes any generative checkpoint an embedder (`--pooling-type`,
  `--pooling-normalize` choose how; last token and normalized by default).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config import doc


class PoolingTask(enum.Enum):
    EMBED = "embed"
    CLASSIFY = "classify"


class PoolingType(enum.Enum):
    LAST = "LAST"
    """The last token's hidden state."""
    MEAN = "MEAN"
    """The mean over every token (the prompt's first included)."""
    CLS = "CLS"
    """The first token's."""
    ALL = "ALL"
    """Every token's, one row each."""


class Activation(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


RUNNERS = ("auto", "generate", "pooling")

# sentence-transformers' pooling modes, in its two spellings (a name, or one flag each).
_ST_MODES = {"cls": PoolingType.CLS, "mean": PoolingType.MEAN, "lasttoken": PoolingType.LAST}
_ST_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
             "pooling_mode_weightedmean_tokens": "weightedmean"}
_BARE_DECODERS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
CLASSIFIER_SUFFIX = "ForSequenceClassification"


@dataclass(frozen=True)
class PoolingConfig:
    runner: str = doc(
        "What the engines run: generate (an LM head samples tokens), pooling (prompts "
        "in, pooled hidden states or a score head's outputs out: embeddings, "
        "classification, reranking), or auto (pooling for a *ForSequenceClassification "
        "checkpoint, a sentence-transformers folder or a bare decoder; else generate).",
        default="auto")
    pooling_type: str = doc(
        "Pooling runner: how token states become one vector, LAST, MEAN, CLS or ALL (one "
        "row per token); empty: the checkpoint's (1_Pooling/config.json), else LAST.",
        default="")
    pooling_normalize: str = doc(
        "Pooling runner: L2-normalize embeddings, true or false; empty: the checkpoint's "
        "(a Normalize module), else true.", default="")

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.pooling_type and self.pooling_type.upper() not in PoolingType.__members__:
            raise ValueError(f"pooling_type must be one of "
                             f"{', '.join(PoolingType.__members__)}, got {self.pooling_type!r}")
        if self.pooling_normalize not in ("", "true", "false"):
            raise ValueError(f"pooling_normalize must be true or false, got "
                             f"{self.pooling_normalize!r}")


@dataclass(frozen=True, slots=True)
class Pooler:
    """What a pooling model computes by default; requests may override the pooling and
    the normalization (`PoolingParams`)."""

    task: PoolingTask
    pooling_type: PoolingType
    normalize: bool
    hidden_size: int
    num_labels: int = 0
    """Classification: outputs of the score head."""
    labels: tuple[str, ...] = ()
    """Classification: the name of each output (`id2label`), in order."""
    activation: Activation | None = None
    """Classification: what turns the head's logits into scores."""
    prompts: dict[str, str] = field(default_factory=dict)
    """sentence-transformers' named prompts ("query" -> "query: "), prepended to texts."""
    default_prompt_name: str | None = None
    source: str = ""
    """Where these settings came from, for the load log."""

    @property
    def tasks(self) -> tuple[str, ...]:
        """What the model serves, as the APIs name it."""
        if self.task is PoolingTask.CLASSIFY:
            # A one-output head scores pairs (a cross-encoder), or rewards a text.
            return ("classify", "score") if self.num_labels == 1 else ("classify",)
        return ("embed", "score")

    @property
    def dimensions(self) -> int:
        """Length of one pooled vector as the model gives it."""
        return self.num_labels if self.task is PoolingTask.CLASSIFY else self.hidden_size


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """One pooling request's settings; None leaves the model's default."""

    task: PoolingTask = PoolingTask.EMBED
    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    """Matryoshka truncation: keep the first `dimensions` values (then normalize)."""
    activation: bool | None = None
    """Classification: apply the model's softmax or sigmoid (default) or return logits."""


def resolve_pooler(folder: str | Path, config: PoolingConfig | None = None) -> Pooler | None:
    """The checkpoint's pooler under `config`'s runner; None for a generative engine.
    Raises ValueError naming the file and setting that cannot be served."""
    config = config or PoolingConfig()
    folder = Path(folder)
    hf = _read_json(folder / "config.json")
    text = {**hf, **hf["text_config"]} if isinstance(hf.get("text_config"), dict) else hf
    architectures = [str(a) for a in hf.get("architectures") or ()]
    classifier = any(a.endswith(CLASSIFIER_SUFFIX) for a in architectures)
    st_modules = folder / "modules.json"
    bare = any(a in _BARE_DECODERS for a in architectures)
    if config.runner == "generate":
        if classifier or bare:
            raise ValueError(f"{folder} holds a {architectures[0]}, which has no LM head to "
                             "generate with: serve it with --runner pooling (or auto)")
        return None
    if config.runner == "auto" and not (classifier or bare or st_modules.is_file()):
        return None
    hidden = int(text.get("hidden_size") or 0)
    if classifier:
        return _classifier(text, hidden, config, architectures)
    pooling, normalize, source = PoolingType.LAST, True, "the default for decoders"
    prompts: dict[str, str] = {}
    default_prompt: str | None = None
    if st_modules.is_file():
        pooling, normalize = _sentence_transformers(folder, st_modules)
        source = f"sentence-transformers ({st_modules.name})"
        st = folder / "config_sentence_transformers.json"
        if st.is_file():
            extra = _read_json(st)
            prompts = {str(k): str(v) for k, v in (extra.get("prompts") or {}).items()}
            default_prompt = extra.get("default_prompt_name") or None
    if config.pooling_type:
        pooling, source = PoolingType[config.pooling_type.upper()], "--pooling-type"
    if config.pooling_normalize:
        normalize = config.pooling_normalize == "true"
    return Pooler(PoolingTask.EMBED, pooling, normalize, hidden, prompts=prompts,
                  default_prompt_name=default_prompt, source=source)


def _classifier(hf: dict[str, Any], hidden: int, config: PoolingConfig,
                architectures: list[str]) -> Pooler:
    num_labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
    id2label = hf.get("id2label") or {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                   for i in range(num_labels))
    multi = hf.get("problem_type") == "multi_label_classification"
    activation = Activation.SIGMOID if num_labels == 1 or multi else Activation.SOFTMAX
    if config.pooling_type and config.pooling_type.upper() != "LAST":
        raise ValueError(f"{architectures[0]} scores the last token; --pooling-type "
                         f"{config.pooling_type} does not apply")
    return Pooler(PoolingTask.CLASSIFY, PoolingType.LAST, False, hidden, num_labels, labels,
                  activation, source=f"{architectures[0]} (score head, {activation.value})")


def _sentence_transformers(folder: Path, modules_path: Path) -> tuple[PoolingType, bool]:
    modules = json.loads(modules_path.read_text(encoding="utf-8"))
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path} does not hold a list of modules")
    pooling: PoolingType | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _st_pooling(folder / str(module.get("path", "")) / "config.json")
        else:
            raise ValueError(f"{modules_path}: module {module.get('type')!r} is not served "
                             "(Transformer, Pooling and Normalize are)")
    if pooling is None:
        raise ValueError(f"{modules_path} has no Pooling module")
    return pooling, normalize


def _st_pooling(path: Path) -> PoolingType:
    settings = _read_json(path)
    mode = settings.get("pooling_mode")
    if mode is None:
        on = [name for flag, name in _ST_FLAGS.items() if settings.get(flag)]
        if len(on) != 1:
            raise ValueError(f"{path}: exactly one pooling mode must be on, found {on}")
        mode = on[0]
    if mode not in _ST_MODES:
        raise ValueError(f"{path}: pooling mode {mode!r} is not served (choose one of "
                         f"{', '.join(_ST_MODES)})")
    if settings.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt false (pooling that skips the prompt) is "
                         "not served")
    return _ST_MODES[mode]


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


class TaskMismatch(ValueError):
    """A request for a task the model does not serve (FAILED_PRECONDITION)."""


def resolve_params(params: PoolingParams, pooler: Pooler) -> PoolingParams:
    """`params` with the model's defaults filled in; TaskMismatch for a task it does
    not serve, ValueError naming the field for a setting it cannot take."""
    if params.task is not pooler.task:
        raise TaskMismatch(
            f"this model serves {' and '.join(pooler.tasks)}, not {params.task.value}")
    pooling_type = params.pooling_type or pooler.pooling_type
    if pooler.task is PoolingTask.CLASSIFY:
        if pooling_type is not PoolingType.LAST:
            raise ValueError(f"pooling_type: a classifier scores the last token, not "
                             f"{pooling_type.value}")
        if params.dimensions is not None:
            raise ValueError("dimensions: a classifier's outputs cannot be truncated")
    elif params.dimensions is not None and not 1 <= params.dimensions <= pooler.hidden_size:
        raise ValueError(f"dimensions must be in [1, {pooler.hidden_size}] (the model's "
                         f"embedding size), got {params.dimensions}")
    return PoolingParams(
        params.task, pooling_type,
        pooler.normalize if params.normalize is None else params.normalize,
        params.dimensions, True if params.activation is None else params.activation)
