"""Protobuf <-> internal dataclasses, at the edge of every service."""

from __future__ import annotations

from corestream.common.v1 import common_pb2

from services.common.constraints import ConstraintKind, OutputConstraint
from services.common.sampling import SamplingParams


def sampling_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the dataclass defaults; values are not validated here."""
    d = SamplingParams()
    return SamplingParams(
        temperature=pb.temperature if pb.HasField("temperature") else d.temperature,
        top_p=pb.top_p if pb.HasField("top_p") else d.top_p,
        # -1 is the other common spelling of "off".
        top_k=(pb.top_k if pb.top_k != -1 else 0) if pb.HasField("top_k") else d.top_k,
        min_p=pb.min_p if pb.HasField("min_p") else d.min_p,
        seed=pb.seed if pb.HasField("seed") else d.seed,
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else d.max_tokens,
        min_tokens=pb.min_tokens if pb.HasField("min_tokens") else d.min_tokens,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        include_stop_str_in_output=pb.include_stop_str_in_output,
        repetition_penalty=(
            pb.repetition_penalty if pb.HasField("repetition_penalty") else d.repetition_penalty
        ),
        presence_penalty=(
            pb.presence_penalty if pb.HasField("presence_penalty") else d.presence_penalty
        ),
        frequency_penalty=(
            pb.frequency_penalty if pb.HasField("frequency_penalty") else d.frequency_penalty
        ),
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        n=pb.n if pb.HasField("n") else d.n,
        logprobs=pb.logprobs if pb.HasField("logprobs") else d.logprobs,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else d.prompt_logprobs,
        constraint=constraint_from_proto(pb),
    )


def constraint_from_proto(pb: common_pb2.SamplingParams) -> OutputConstraint | None:
    """The oneof `constraint`; json_object = false constrains nothing."""
    which = pb.WhichOneof("constraint")
    if which is None or (which == "json_object" and not pb.json_object):
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.CHOICE:
        return OutputConstraint(kind, choices=tuple(pb.choice.choices))
    if kind is ConstraintKind.JSON_OBJECT:
        return OutputConstraint(kind)
    return OutputConstraint(kind, spec=getattr(pb, which))


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=dict(p.logit_bias),
        n=p.n,
    )
    if p.seed is not None:
        pb.seed = p.seed
    if p.max_tokens is not None:
        pb.max_tokens = p.max_tokens
    if p.logprobs is not None:
        pb.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        pb.prompt_logprobs = p.prompt_logprobs
    if p.constraint is not None:
        _constraint_to_proto(p.constraint, pb)
    return pb


def _constraint_to_proto(c: OutputConstraint, pb: common_pb2.SamplingParams) -> None:
    if c.kind is ConstraintKind.CHOICE:
        pb.choice.choices.extend(c.choices)
    elif c.kind is ConstraintKind.JSON_OBJECT:
        pb.json_object = True
    else:
        setattr(pb, c.kind.value, c.spec)
