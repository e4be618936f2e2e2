"""CANN's two-phase ``aclnn`` API over the sparseops Python ops (spec/moe.md §6, spec/nsa.md §7).

A thin shell with no math of its own. Each CANN operator gets its two functions under CANN's exact names
and parameter order::

    status, workspace_size, executor = aclnnXxxGetWorkspaceSize(<inputs>, <attributes>, <out tensors>)
    status = aclnnXxx(workspace, workspace_size, executor, stream)

- Nothing raises: every failure is a status; :func:`aclGetRecentErrMsg` returns its text, which names the
  parameter by its CANN name and carries the Python op's own message.
- Phase 1 validates everything: null tensors, dtypes, layout and out tensors here, then every check of the
  Python op (its own validator, data-dependent checks included: ``sortedIndices`` is a permutation, block
  ids are in range). It computes nothing and writes nothing.
- Phase 2 only computes: it runs the Python op (``validate=False``, all checks done) and copies its results
  into the caller's out tensors.
- An executor runs once; ``workspace_size`` is the bytes of the temporary results phase 2 allocates before
  copying them into the out tensors (see docs/aclnn.md).

Status codes: :data:`ACLNN_SUCCESS`, :data:`ACLNN_ERR_PARAM_NULLPTR` (a required tensor or out tensor is
None), :data:`ACLNN_ERR_PARAM_INVALID` (unsupported dtype / format / layout, float64, int64 index tensors,
a bad executor, workspace or stream), :data:`ACLNN_ERR_INNER_TILING_ERROR` (a shape or attribute
constraint, anything else the Python op rejects), :data:`ACLNN_ERR_RUNTIME_ERROR` (an unexpected failure
while computing).
"""

from __future__ import annotations

import re
import threading

import torch

from . import _config

__all__ = [
    "ACLNN_ERR_INNER_TILING_ERROR",
    "ACLNN_ERR_PARAM_INVALID",
    "ACLNN_ERR_PARAM_NULLPTR",
    "ACLNN_ERR_RUNTIME_ERROR",
    "ACLNN_SUCCESS",
    "ACL_ERROR_INVALID_PARAM",
    "ACL_OPT_DETERMINISTIC",
    "ACL_SUCCESS",
    "AclOpExecutor",
    "aclGetRecentErrMsg",
    "aclnnMoeTokenPermuteWithEp",
    "aclnnMoeTokenPermuteWithEpGetWorkspaceSize",
    "aclnnMoeTokenPermuteWithEpGrad",
    "aclnnMoeTokenPermuteWithEpGradGetWorkspaceSize",
    "aclnnMoeTokenUnpermuteWithEp",
    "aclnnMoeTokenUnpermuteWithEpGetWorkspaceSize",
    "aclnnMoeTokenUnpermuteWithEpGrad",
    "aclnnMoeTokenUnpermuteWithEpGradGetWorkspaceSize",
    "aclnnNsaSelectedAttention",
    "aclnnNsaSelectedAttentionGetWorkspaceSize",
    "aclnnNsaSelectedAttentionGrad",
    "aclnnNsaSelectedAttentionGradGetWorkspaceSize",
    "aclrtCtxGetSysParamOpt",
    "aclrtCtxSetSysParamOpt",
]

ACLNN_SUCCESS = 0
#: a required input tensor, out tensor or the executor is None (C: a null pointer)
ACLNN_ERR_PARAM_NULLPTR = 161001
#: unsupported dtype / format / layout; float64; int64 sortedIndices / topkIndices; bad executor or workspace
ACLNN_ERR_PARAM_INVALID = 161002
#: unexpected failure while computing (C: a runtime call failed)
ACLNN_ERR_RUNTIME_ERROR = 361001
#: shape or attribute constraint (K > 512, bad range, block size, sparse mode, out shape, ...)
ACLNN_ERR_INNER_TILING_ERROR = 561002

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
#: ``aclSysParamOpt`` value of the determinism switch (acl_base.h)
ACL_OPT_DETERMINISTIC = 0

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FLOAT_NAMES = "FLOAT, FLOAT16, BFLOAT16"

_tls = threading.local()


def aclGetRecentErrMsg() -> str | None:  # noqa: N802 (CANN's name)
    """The text of the last failure of an ``aclnn*`` call in this thread; None when the last call succeeded."""
    return getattr(_tls, "msg", None)


class _Fail(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status
        self.msg = msg


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _shape(t) -> str:
    return "[" + ", ".join(str(int(s)) for s in t) + "]"


# ----------------------------------------------------------------------------------------------------------------
# The executor and the two phases
# ----------------------------------------------------------------------------------------------------------------


class AclOpExecutor:
    """What phase 1 hands back: the validated call, run once by phase 2. Opaque to callers."""

    __slots__ = ("_api", "_run", "_workspace_size", "_device", "_used")

    def __init__(self, api: str, run, workspace_size: int, device: torch.device):
        self._api = api
        self._run = run
        self._workspace_size = int(workspace_size)
        self._device = device
        self._used = False

    def __repr__(self) -> str:
        state = "used" if self._used else "ready"
        return f"<AclOpExecutor {self._api} workspace={self._workspace_size} {state}>"


def _record(api: str, status: int, msg: str) -> int:
    _tls.msg = f"{api} failed with status {status}: {msg}"
    return status


def _python_error(exc: BaseException, names: dict[str, str]) -> tuple[int, str]:
    """Status and message for an exception raised by a Python op's argument checks. The Python message
    starts with the argument's Python name; put the CANN name in front of it."""
    msg = str(exc)
    head = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", msg)
    cann = names.get(head.group(1)) if head else None
    text = f"{cann}: {msg}" if cann and cann != head.group(1) else msg  # no "key: key: ..."
    status = ACLNN_ERR_PARAM_INVALID if isinstance(exc, TypeError) else ACLNN_ERR_INNER_TILING_ERROR
    return status, text


def _phase1(api: str, build) -> tuple[int, int, AclOpExecutor | None]:
    _tls.msg = None
    try:
        run, workspace_size, device = build()
    except _Fail as f:
        return _record(api, f.status, f.msg), 0, None
    except Exception as exc:  # never raise to the caller
        return _record(api, ACLNN_ERR_INNER_TILING_ERROR, f"unexpected {type(exc).__name__}: {exc}"), 0, None
    return ACLNN_SUCCESS, workspace_size, AclOpExecutor(api, run, workspace_size, device)


def _phase2(api: str, workspace, workspace_size, executor, stream) -> int:
    _tls.msg = None
    phase1 = api + "GetWorkspaceSize"
    if executor is None:
        return _record(api, ACLNN_ERR_PARAM_NULLPTR, "executor: is None (nullptr)")
    if not isinstance(executor, AclOpExecutor):
        return _record(
            api, ACLNN_ERR_PARAM_INVALID,
            f"executor: expected the AclOpExecutor returned by {phase1}, got {type(executor).__name__}",
        )
    if executor._api != api:
        return _record(
            api, ACLNN_ERR_PARAM_INVALID,
            f"executor: was created by {executor._api}GetWorkspaceSize, not by {phase1}",
        )
    if executor._used:
        return _record(
            api, ACLNN_ERR_PARAM_INVALID,
            f"executor: has already run; an executor runs once, call {phase1} again",
        )
    need = executor._workspace_size
    if isinstance(workspace_size, bool) or not isinstance(workspace_size, int) or workspace_size < 0:
        return _record(api, ACLNN_ERR_PARAM_INVALID, f"workspaceSize: expected an int >= 0, got {workspace_size!r}")
    if workspace_size < need:
        return _record(
            api, ACLNN_ERR_PARAM_INVALID,
            f"workspaceSize: expected >= {need} bytes (as returned by {phase1}), got {workspace_size}",
        )
    if workspace is None:
        if need > 0:
            return _record(api, ACLNN_ERR_PARAM_NULLPTR, f"workspace: is None but {need} bytes are needed")
    else:
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
            got = _dtype_name(workspace.dtype) + " tensor" if isinstance(workspace, torch.Tensor) else type(workspace).__name__
            return _record(api, ACLNN_ERR_PARAM_INVALID, f"workspace: expected None or a uint8 tensor, got {got}")
        if workspace.numel() < max(need, workspace_size):
            return _record(
                api, ACLNN_ERR_PARAM_INVALID,
                f"workspace: expected at least {max(need, workspace_size)} bytes, got a tensor of {workspace.numel()}",
            )
        if need > 0 and workspace.device != executor._device:
            return _record(
                api, ACLNN_ERR_PARAM_INVALID,
                f"workspace: expected a tensor on {executor._device}, got one on {workspace.device}",
            )
    if stream is not None and not (torch.cuda.is_available() and isinstance(stream, torch.cuda.Stream)):
        return _record(api, ACLNN_ERR_PARAM_INVALID, f"stream: expected None or a torch.cuda.Stream, got {type(stream).__name__}")
    executor._used = True
    try:
        with torch.no_grad():
            if stream is not None:
                with torch.cuda.stream(stream):
                    executor._run()
            else:
                executor._run()
    except _Fail as f:
        return _record(api, f.status, f.msg)
    except (ValueError, TypeError, NotImplementedError) as exc:
        # phase 1 ran every check, so this is not expected; the op raises before anything is written
        status, text = _python_error(exc, executor._run.names)
        return _record(api, status, text)
    except Exception as exc:
        return _record(api, ACLNN_ERR_RUNTIME_ERROR, f"{type(exc).__name__}: {exc}")
    return ACLNN_SUCCESS


class _Runner:
    """Phase 2's work: call the op, copy its results into the out tensors. The out tensors' shape, dtype and
    device are checked again first (phase 1 checked them; a tensor resized between the phases would otherwise
    fail half-way through the copies, after some outs were written)."""

    __slots__ = ("call", "store", "names", "outs")

    def __init__(self, call, store, names, outs):
        self.call, self.store, self.names = call, store, names
        self.outs = {name: (t, tuple(t.shape), t.dtype, t.device) for name, t in outs.items()}

    def __call__(self):
        for name, (t, shape, dtype, device) in self.outs.items():
            now = (tuple(t.shape), t.dtype, t.device)
            if now != (shape, dtype, device):
                raise _Fail(
                    ACLNN_ERR_INNER_TILING_ERROR,
                    f"{name}: changed since phase 1: expected shape {_shape(shape)} {_dtype_name(dtype)} on {device}, "
                    f"got {_shape(now[0])} {_dtype_name(now[1])} on {now[2]}",
                )
        self.store(self.call())


# ----------------------------------------------------------------------------------------------------------------
# Phase-1 checks of the CANN layer
# ----------------------------------------------------------------------------------------------------------------


def _tensor(name: str, t, *, required: bool = True, dtypes=_FLOATS, dtype_names: str = _FLOAT_NAMES):
    if t is None:
        if required:
            raise _Fail(ACLNN_ERR_PARAM_NULLPTR, f"{name}: a required tensor is None (nullptr)")
        return None
    if not isinstance(t, torch.Tensor):
        raise _Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise _Fail(
            ACLNN_ERR_PARAM_INVALID,
            f"{name}: dtype {_dtype_name(t.dtype)} is not supported, expected one of {{{dtype_names}}}",
        )
    return t


def _index32(name: str, t, *, required: bool = True):
    return _tensor(name, t, required=required, dtypes=(torch.int32,), dtype_names="INT32 (CANN takes INT32 only)")


def _bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise _Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a bool, got {type(v).__name__} ({v!r})")
    return v


def _int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected an int, got {type(v).__name__} ({v!r})")
    return v


def _padded(v) -> None:
    if _bool("paddedMode", v):
        raise _Fail(ACLNN_ERR_INNER_TILING_ERROR, "paddedMode: only false is supported (CANN documents false only), got true")


def _int_array(name: str, v):
    """An ``aclIntArray``: None, a list/tuple of ints or a 1-D integer tensor -> list of ints (or None)."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise _Fail(
                ACLNN_ERR_PARAM_INVALID,
                f"{name}: expected an int array (list of ints or 1-D integer tensor), got a {v.dim()}-D {_dtype_name(v.dtype)} tensor",
            )
        return [int(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int):
                raise _Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected an int array, got an element {x!r}")
        return [int(x) for x in v]
    raise _Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected an int array (list of ints) or None, got {type(v).__name__}")


def _window_rows(names: dict[str, str], rng, sorted_indices, t: torch.Tensor, cann: str):
    """The window ``(s, e)`` of spec/moe.md §2 for a permuted-side input ``t`` that may be taller than it (CANN
    documents ``[N, H]``): its first ``R = e - s`` rows are read. Returns ``(s, e, t[:R])``; when the shapes are
    too broken to tell, ``t`` is returned whole and the op's validator reports them."""
    if t.dim() < 1 or sorted_indices.dim() != 1:
        return None, None, t
    N = sorted_indices.shape[0]
    s, e = _validate(names, _moe().normalize_range, rng, N, min(t.shape[0], N))
    if t.shape[0] < e - s:
        raise _Fail(
            ACLNN_ERR_INNER_TILING_ERROR,
            f"{cann}: expected at least R={e - s} rows for the window [{s}, {e}), got shape {_shape(t.shape)}",
        )
    return s, e, t[: e - s]


def _layout(v) -> None:
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    if v != "TND":
        raise _Fail(ACLNN_ERR_PARAM_INVALID, f"inputLayout: only \"TND\" is supported, got {v!r}")


def _same_device(**tensors) -> torch.device:
    devs = {k: t.device for k, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devs.items())
        raise _Fail(ACLNN_ERR_INNER_TILING_ERROR, f"all tensors must be on one device, got {listing}")
    return next(iter(devs.values())) if devs else torch.device("cpu")


def _out(name: str, t, shape, dtype: torch.dtype) -> torch.Tensor:
    """An out tensor: present, of a supported dtype (else 161002), of exactly ``shape`` and ``dtype`` (else 561002)."""
    if t is None:
        raise _Fail(ACLNN_ERR_PARAM_NULLPTR, f"{name}: a required out tensor is None (nullptr)")
    if not isinstance(t, torch.Tensor):
        raise _Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS + (torch.int32,):
        raise _Fail(ACLNN_ERR_PARAM_INVALID, f"{name}: dtype {_dtype_name(t.dtype)} is not supported")
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise _Fail(
            ACLNN_ERR_PARAM_INVALID,
            f"{name}: an out tensor must not overlap itself (got a broadcast view with strides {tuple(t.stride())})",
        )
    if tuple(t.shape) != tuple(shape):
        raise _Fail(ACLNN_ERR_INNER_TILING_ERROR, f"{name}: expected shape {_shape(shape)}, got {_shape(t.shape)}")
    if t.dtype != dtype:
        raise _Fail(ACLNN_ERR_INNER_TILING_ERROR, f"{name}: expected dtype {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    return t


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _validate(names: dict[str, str], fn, *args, **kwargs):
    """Run one of the Python op's validators (no computing); its ValueError / TypeError becomes a status."""
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise _Fail(*_python_error(exc, names)) from None


def _moe():
    from .moe import api

    return api


def _nsa():
    from .nsa import api

    return api


# ----------------------------------------------------------------------------------------------------------------
# MoE: permute
# ----------------------------------------------------------------------------------------------------------------

_PERMUTE_NAMES = {
    "tokens": "tokens", "indices": "indices", "probs": "probsOptional", "range": "rangeOptional",
    "num_out_tokens": "numOutTokens", "padded_mode": "paddedMode",
}


def aclnnMoeTokenPermuteWithEpGetWorkspaceSize(  # noqa: N802
    tokens, indices, probsOptional, rangeOptional, numOutTokens, paddedMode,  # noqa: N803
    permuteTokensOut, sortedIndicesOut, permuteProbsOut,  # noqa: N803
):
    """Phase 1 of ``moe_token_permute_with_ep``. Returns ``(status, workspace_size, executor)``.

    Args:
        tokens: `[T, H]` fp32/fp16/bf16.
        indices: `[T, K]` or `[T]` int32/int64 expert ids.
        probsOptional: `[T, K]` fp32/fp16/bf16 or None.
        rangeOptional: `[start, end]` (list of ints, or None for the whole window).
        numOutTokens: int, applies when ``rangeOptional`` is None.
        paddedMode: bool, only False.
        permuteTokensOut: out `[R, H]` tokens.dtype.
        sortedIndicesOut: out `[N]` int32.
        permuteProbsOut: out `[R]` probs.dtype; required when probsOptional is given, else ignored.
    """
    api = "aclnnMoeTokenPermuteWithEp"

    def build():
        _tensor("tokens", tokens)
        _tensor("indices", indices, dtypes=(torch.int32, torch.int64), dtype_names="INT32, INT64")
        _tensor("probsOptional", probsOptional, required=False)
        rng = _int_array("rangeOptional", rangeOptional)
        n_out = _int("numOutTokens", numOutTokens)
        _padded(paddedMode)
        device = _same_device(tokens=tokens, indices=indices, probsOptional=probsOptional)
        moe = _moe()
        _, _, _, K, s, e = _validate(_PERMUTE_NAMES, moe.check_permute_args, tokens, indices, probsOptional, rng,
                                     n_out, False, validate=True)
        N, H, R = indices.numel(), tokens.shape[1], e - s
        outs = {"permuteTokensOut": _out("permuteTokensOut", permuteTokensOut, (R, H), tokens.dtype),
                "sortedIndicesOut": _out("sortedIndicesOut", sortedIndicesOut, (N,), torch.int32)}
        ws = _nbytes((R, H), tokens.dtype) + _nbytes((N,), torch.int32)
        if probsOptional is not None:
            outs["permuteProbsOut"] = _out("permuteProbsOut", permuteProbsOut, (R,), probsOptional.dtype)
            ws += _nbytes((R,), probsOptional.dtype)
        _same_device(tokens=tokens, **outs)

        def call():
            return moe.moe_token_permute_with_ep(tokens, indices, probsOptional, rng, n_out, False,
                                                 backend="auto", validate=False)

        def store(res):
            pt, si, pp = res
            permuteTokensOut.copy_(pt)
            sortedIndicesOut.copy_(si)
            if probsOptional is not None:
                permuteProbsOut.copy_(pp)

        return _Runner(call, store, _PERMUTE_NAMES, outs), ws, device

    return _phase1(api, build)


def aclnnMoeTokenPermuteWithEp(workspace, workspaceSize, executor, stream):  # noqa: N802, N803
    """Phase 2 of ``moe_token_permute_with_ep``: computes into the out tensors. Returns a status."""
    return _phase2("aclnnMoeTokenPermuteWithEp", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------------------------------
# MoE: unpermute
# ----------------------------------------------------------------------------------------------------------------

_UNPERMUTE_NAMES = {
    "permuted_tokens": "permutedTokens", "sorted_indices": "sortedIndices", "probs": "probsOptional",
    "topk_num": "numTopk", "range": "rangeOptional", "padded_mode": "paddedMode",
    "restore_shape": "restoreShapeOptional",
}


def aclnnMoeTokenUnpermuteWithEpGetWorkspaceSize(  # noqa: N802
    permutedTokens, sortedIndices, probsOptional, numTopk, rangeOptional, paddedMode,  # noqa: N803
    restoreShapeOptional, out,  # noqa: N803
):
    """Phase 1 of ``moe_token_unpermute_with_ep``. Returns ``(status, workspace_size, executor)``.

    Args:
        permutedTokens: `[>= R, H]`; the first R rows are read (R = window length).
        sortedIndices: `[N]` int32.
        probsOptional: `[T, K]` or None.
        numTopk: int, K when probsOptional is None.
        rangeOptional: `[start, end]` or None (None: the rows of permutedTokens).
        paddedMode: bool, only False.
        restoreShapeOptional: None or `[T, H]`.
        out: out `[T, H]` permutedTokens.dtype.
    """
    api = "aclnnMoeTokenUnpermuteWithEp"

    def build():
        _tensor("permutedTokens", permutedTokens)
        _index32("sortedIndices", sortedIndices)
        _tensor("probsOptional", probsOptional, required=False)
        topk = _int("numTopk", numTopk)
        rng = _int_array("rangeOptional", rangeOptional)
        _padded(paddedMode)
        restore = _int_array("restoreShapeOptional", restoreShapeOptional)
        device = _same_device(permutedTokens=permutedTokens, sortedIndices=sortedIndices, probsOptional=probsOptional)
        moe = _moe()
        _, _, pt = _window_rows(_UNPERMUTE_NAMES, rng, sortedIndices, permutedTokens, "permutedTokens")
        _, _, _, K, s, e = _validate(_UNPERMUTE_NAMES, moe.check_unpermute_args, pt, sortedIndices, probsOptional,
                                     topk, rng, False, restore, validate=True)
        T, H = sortedIndices.shape[0] // K, pt.shape[1]
        _out("out", out, (T, H), pt.dtype)
        _same_device(permutedTokens=pt, out=out)

        def call():
            return moe.moe_token_unpermute_with_ep(pt, sortedIndices, probsOptional, topk, rng, False, restore,
                                                   backend="auto", validate=False)

        return _Runner(call, out.copy_, _UNPERMUTE_NAMES, {"out": out}), _nbytes((T, H), pt.dtype), device

    return _phase1(api, build)


def aclnnMoeTokenUnpermuteWithEp(workspace, workspaceSize, executor, stream):  # noqa: N802, N803
    """Phase 2 of ``moe_token_unpermute_with_ep``. Returns a status."""
    return _phase2("aclnnMoeTokenUnpermuteWithEp", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------------------------------
# MoE: unpermute grad (the seed op)
# ----------------------------------------------------------------------------------------------------------------

_UNPERMUTE_GRAD_NAMES = {
    "unpermuted_tokens_grad": "unpermutedTokensGrad", "sorted_indices": "sortedIndices",
    "permuted_tokens": "permutedTokensOptional", "probs": "probsOptional", "padded_mode": "paddedMode",
    "restore_shape": "restoreShapeOptional", "range": "rangeOptional", "topk_num": "topkNum",
}


def aclnnMoeTokenUnpermuteWithEpGradGetWorkspaceSize(  # noqa: N802
    unpermutedTokensGrad, sortedIndices, permutedTokensOptional, probsOptional, paddedMode,  # noqa: N803
    restoreShapeOptional, rangeOptional, topkNum, permutedTokensGradOut, probsGradOut,  # noqa: N803
):
    """Phase 1 of ``moe_token_unpermute_with_ep_grad``. Returns ``(status, workspace_size, executor)``.

    Args:
        unpermutedTokensGrad: `[T, H]` fp32/fp16/bf16.
        sortedIndices: `[N]` int32, N = T*K.
        permutedTokensOptional: `[>= R, H]` (CANN documents `[N, H]`); the first R rows are read. Required
            when probsOptional is given.
        probsOptional: `[T, K]` or None.
        paddedMode: bool, only False.
        restoreShapeOptional: None or `[T, H]`.
        rangeOptional: `[start, end]` or None.
        topkNum: int, K when probsOptional is None.
        permutedTokensGradOut: out `[N, H]` grad dtype: rows `[0, R)` get the result, the rest zeros.
        probsGradOut: out `[T, K]` probs dtype; required when probsOptional is given, else ignored.
    """
    api = "aclnnMoeTokenUnpermuteWithEpGrad"

    def build():
        g = _tensor("unpermutedTokensGrad", unpermutedTokensGrad)
        _index32("sortedIndices", sortedIndices)
        pt = _tensor("permutedTokensOptional", permutedTokensOptional, required=False)
        _tensor("probsOptional", probsOptional, required=False)
        _padded(paddedMode)
        restore = _int_array("restoreShapeOptional", restoreShapeOptional)
        rng = _int_array("rangeOptional", rangeOptional)
        topk = _int("topkNum", topkNum)
        if probsOptional is not None and pt is None:
            raise _Fail(ACLNN_ERR_PARAM_NULLPTR, "permutedTokensOptional: is None but probsOptional is given (needed for probsGradOut)")
        device = _same_device(unpermutedTokensGrad=g, sortedIndices=sortedIndices, permutedTokensOptional=pt,
                              probsOptional=probsOptional)
        moe = _moe()
        if pt is not None:
            _, _, pt = _window_rows(_UNPERMUTE_GRAD_NAMES, rng, sortedIndices, pt, "permutedTokensOptional")
        _, _, _, _, K, s, e = _validate(_UNPERMUTE_GRAD_NAMES, moe.check_unpermute_grad_args, g, sortedIndices, pt,
                                        probsOptional, False, restore, rng, topk, validate=True)
        (T, H), N, R = g.shape, sortedIndices.shape[0], e - s
        outs = {"permutedTokensGradOut": _out("permutedTokensGradOut", permutedTokensGradOut, (N, H), g.dtype)}
        ws = _nbytes((R, H), g.dtype)
        if probsOptional is not None:
            outs["probsGradOut"] = _out("probsGradOut", probsGradOut, (T, K), probsOptional.dtype)
            ws += _nbytes((T, K), probsOptional.dtype)
        _same_device(unpermutedTokensGrad=g, **outs)

        def call():
            return moe.moe_token_unpermute_with_ep_grad(g, sortedIndices, pt, probsOptional, False, restore, rng, topk,
                                                        backend="auto", validate=False)

        def store(res):
            ptg, pg = res
            permutedTokensGradOut[:R].copy_(ptg)
            permutedTokensGradOut[R:].zero_()
            if probsOptional is not None:
                probsGradOut.copy_(pg)

        return _Runner(call, store, _UNPERMUTE_GRAD_NAMES, outs), ws, device

    return _phase1(api, build)


def aclnnMoeTokenUnpermuteWithEpGrad(workspace, workspaceSize, executor, stream):  # noqa: N802, N803
    """Phase 2 of ``moe_token_unpermute_with_ep_grad``. Returns a status."""
    return _phase2("aclnnMoeTokenUnpermuteWithEpGrad", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------------------------------
# MoE: permute grad
# ----------------------------------------------------------------------------------------------------------------

_PERMUTE_GRAD_NAMES = {
    "permuted_tokens_grad": "permutedTokensOutputGrad", "sorted_indices": "sortedIndices",
    "permuted_probs_grad": "permutedProbsOutputGradOptional", "topk_num": "numTopk", "range": "rangeOptional",
    "padded_mode": "paddedMode",
}


def aclnnMoeTokenPermuteWithEpGradGetWorkspaceSize(  # noqa: N802
    permutedTokensOutputGrad, sortedIndices, permutedProbsOutputGradOptional, numTopk, rangeOptional,  # noqa: N803
    paddedMode, tokenGradOut, probsGradOut,  # noqa: N803
):
    """Phase 1 of ``moe_token_permute_with_ep_grad``. Returns ``(status, workspace_size, executor)``.

    Args:
        permutedTokensOutputGrad: `[>= R, H]`; the first R rows are read.
        sortedIndices: `[N]` int32.
        permutedProbsOutputGradOptional: `[>= R]` or None; the first R entries are read.
        numTopk: int K.
        rangeOptional: `[start, end]` or None (None: the rows of permutedTokensOutputGrad).
        paddedMode: bool, only False.
        tokenGradOut: out `[T, H]` grad dtype.
        probsGradOut: out `[T, K]` permuted-probs-grad dtype; required when that input is given, else ignored.
    """
    api = "aclnnMoeTokenPermuteWithEpGrad"

    def build():
        g = _tensor("permutedTokensOutputGrad", permutedTokensOutputGrad)
        _index32("sortedIndices", sortedIndices)
        ppg = _tensor("permutedProbsOutputGradOptional", permutedProbsOutputGradOptional, required=False)
        topk = _int("numTopk", numTopk)
        rng = _int_array("rangeOptional", rangeOptional)
        _padded(paddedMode)
        device = _same_device(permutedTokensOutputGrad=g, sortedIndices=sortedIndices,
                              permutedProbsOutputGradOptional=ppg)
        moe = _moe()
        s, e, g = _window_rows(_PERMUTE_GRAD_NAMES, rng, sortedIndices, g, "permutedTokensOutputGrad")
        if ppg is not None and s is not None:
            if ppg.dim() != 1 or ppg.shape[0] < e - s:
                raise _Fail(
                    ACLNN_ERR_INNER_TILING_ERROR,
                    f"permutedProbsOutputGradOptional: expected a 1-D tensor of at least R={e - s} entries, got shape {_shape(ppg.shape)}",
                )
            ppg = ppg[: e - s]
        _, _, _, K, s, e = _validate(_PERMUTE_GRAD_NAMES, moe.check_permute_grad_args, g, sortedIndices, ppg, topk, rng,
                                     False, validate=True)
        T, H = sortedIndices.shape[0] // K, g.shape[1]
        outs = {"tokenGradOut": _out("tokenGradOut", tokenGradOut, (T, H), g.dtype)}
        ws = _nbytes((T, H), g.dtype)
        if ppg is not None:
            outs["probsGradOut"] = _out("probsGradOut", probsGradOut, (T, K), ppg.dtype)
            ws += _nbytes((T, K), ppg.dtype)
        _same_device(permutedTokensOutputGrad=g, **outs)

        def call():
            return moe.moe_token_permute_with_ep_grad(g, sortedIndices, ppg, topk, rng, False,
                                                      backend="auto", validate=False)

        def store(res):
            tg, pg = res
            tokenGradOut.copy_(tg)
            if ppg is not None:
                probsGradOut.copy_(pg)

        return _Runner(call, store, _PERMUTE_GRAD_NAMES, outs), ws, device

    return _phase1(api, build)


def aclnnMoeTokenPermuteWithEpGrad(workspace, workspaceSize, executor, stream):  # noqa: N802, N803
    """Phase 2 of ``moe_token_permute_with_ep_grad``. Returns a status."""
    return _phase2("aclnnMoeTokenPermuteWithEpGrad", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------------------------------
# NSA selected attention
# ----------------------------------------------------------------------------------------------------------------

_NSA_NAMES = {
    "query": "query", "key": "key", "value": "value", "topk_indices": "topkIndices",
    "atten_mask": "attenMaskOptional", "actual_seq_qlen": "actualSeqQLenOptional",
    "actual_seq_kvlen": "actualSeqKvLenOptional", "scale_value": "scaleValue", "head_num": "headNum",
    "sparse_mode": "sparseMode", "selected_block_size": "selectedBlockSize",
    "selected_block_count": "selectedBlockCount", "input_layout": "inputLayout",
    "attention_out": "attentionOut", "attention_out_grad": "attentionOutGrad", "softmax_max": "softmaxMax",
    "softmax_sum": "softmaxSum",
}


def _sparse_mode(v) -> int:
    v = _int("sparseMode", v)
    if v not in (0, 2):
        raise _Fail(ACLNN_ERR_INNER_TILING_ERROR, f"sparseMode: expected 0 (no mask) or 2 (causal), got {v}")
    return v


def _mask(t):
    return _tensor("attenMaskOptional", t, required=False, dtypes=(torch.bool, torch.uint8), dtype_names="BOOL, UINT8")


def aclnnNsaSelectedAttentionGetWorkspaceSize(  # noqa: N802
    query, key, value, topkIndices, attenMaskOptional, actualSeqQLenOptional, actualSeqKvLenOptional,  # noqa: N803
    scaleValue, headNum, inputLayout, sparseMode, selectedBlockSize, selectedBlockCount,  # noqa: N803
    softmaxMaxOut, softmaxSumOut, attentionOut,  # noqa: N803
):
    """Phase 1 of ``nsa_selected_attention``. Returns ``(status, workspace_size, executor)``.

    As CANN documents for this op, ``sparseMode=2`` applies the causal mask only when an
    ``attenMaskOptional`` tensor is passed (its values are not read); without one the call is unmasked.

    Args:
        query: `[T1, N1, Dqk]`; key: `[T2, N2, Dqk]`; value: `[T2, N2, Dv]` fp16/bf16/fp32.
        topkIndices: `[T1, N2, K]` int32.
        attenMaskOptional: 2-D bool/uint8 or None.
        actualSeqQLenOptional, actualSeqKvLenOptional: cumulative lengths (no leading 0) or None.
        scaleValue: float; headNum: int (= N1); inputLayout: "TND"; sparseMode: 0 or 2;
        selectedBlockSize, selectedBlockCount: ints.
        softmaxMaxOut, softmaxSumOut: out `[T1, N1, 8]` fp32.
        attentionOut: out `[T1, N1, Dv]` query.dtype.
    """
    api = "aclnnNsaSelectedAttention"

    def build():
        q, k, v = _tensor("query", query), _tensor("key", key), _tensor("value", value)
        topk = _index32("topkIndices", topkIndices)
        mask = _mask(attenMaskOptional)
        cq = _int_array("actualSeqQLenOptional", actualSeqQLenOptional)
        ckv = _int_array("actualSeqKvLenOptional", actualSeqKvLenOptional)
        _layout(inputLayout)
        mode = 2 if _sparse_mode(sparseMode) == 2 and mask is not None else 0  # CANN's forward rule
        device = _same_device(query=q, key=k, value=v, topkIndices=topk, attenMaskOptional=mask)
        nsa = _nsa()
        _validate(_NSA_NAMES, nsa._check_args, q, k, v, topk, scaleValue, headNum, selectedBlockSize,
                  selectedBlockCount, mask, cq, ckv, mode, "TND", True)
        T1, N1, Dv = q.shape[0], q.shape[1], v.shape[2]
        outs = {
            "softmaxMaxOut": _out("softmaxMaxOut", softmaxMaxOut, (T1, N1, 8), torch.float32),
            "softmaxSumOut": _out("softmaxSumOut", softmaxSumOut, (T1, N1, 8), torch.float32),
            "attentionOut": _out("attentionOut", attentionOut, (T1, N1, Dv), q.dtype),
        }
        _same_device(query=q, **outs)
        ws = 2 * _nbytes((T1, N1, 8), torch.float32) + _nbytes((T1, N1, Dv), q.dtype)

        def call():
            return nsa.nsa_selected_attention(
                q, k, v, topk, scaleValue, headNum, selectedBlockSize, selectedBlockCount, atten_mask=mask,
                actual_seq_qlen=cq, actual_seq_kvlen=ckv, sparse_mode=mode, backend="auto", validate=False,
            )

        def store(res):
            out, m, l = res
            attentionOut.copy_(out)
            softmaxMaxOut.copy_(m)
            softmaxSumOut.copy_(l)

        return _Runner(call, store, _NSA_NAMES, outs), ws, device

    return _phase1(api, build)


def aclnnNsaSelectedAttention(workspace, workspaceSize, executor, stream):  # noqa: N802, N803
    """Phase 2 of ``nsa_selected_attention``. Returns a status."""
    return _phase2("aclnnNsaSelectedAttention", workspace, workspaceSize, executor, stream)


def aclnnNsaSelectedAttentionGradGetWorkspaceSize(  # noqa: N802
    query, key, value, attentionOut, attentionOutGrad, softmaxMax, softmaxSum, topkIndices,  # noqa: N803
    actualSeqQLenOptional, actualSeqKvLenOptional, attenMaskOptional, scaleValue, selectedBlockSize,  # noqa: N803
    selectedBlockCount, headNum, inputLayout, sparseMode, dqOut, dkOut, dvOut,  # noqa: N803
):
    """Phase 1 of ``nsa_selected_attention_grad`` (the seed op). Returns ``(status, workspace_size, executor)``.

    ``sparseMode=2`` masks causally whether or not a mask tensor is passed (CANN's grad rule). Determinism
    follows :func:`aclrtCtxSetSysParamOpt` (``ACL_OPT_DETERMINISTIC``), the same switch as
    :func:`sparseops.set_deterministic`, read when phase 2 runs.

    Args:
        query, key, value: as the forward; attentionOut, attentionOutGrad: `[T1, N1, Dv]`.
        softmaxMax, softmaxSum: `[T1, N1, 8]` fp32.
        topkIndices: `[T1, N2, K]` int32.
        dqOut, dkOut, dvOut: outs shaped and typed like query, key, value.
    """
    api = "aclnnNsaSelectedAttentionGrad"

    def build():
        q, k, v = _tensor("query", query), _tensor("key", key), _tensor("value", value)
        o, do = _tensor("attentionOut", attentionOut), _tensor("attentionOutGrad", attentionOutGrad)
        m = _tensor("softmaxMax", softmaxMax, dtypes=(torch.float32,), dtype_names="FLOAT")
        l = _tensor("softmaxSum", softmaxSum, dtypes=(torch.float32,), dtype_names="FLOAT")
        topk = _index32("topkIndices", topkIndices)
        cq = _int_array("actualSeqQLenOptional", actualSeqQLenOptional)
        ckv = _int_array("actualSeqKvLenOptional", actualSeqKvLenOptional)
        mask = _mask(attenMaskOptional)
        _layout(inputLayout)
        mode = _sparse_mode(sparseMode)
        device = _same_device(query=q, key=k, value=v, attentionOut=o, attentionOutGrad=do, softmaxMax=m,
                              softmaxSum=l, topkIndices=topk, attenMaskOptional=mask)
        nsa = _nsa()
        _validate(_NSA_NAMES, nsa._check_args, q, k, v, topk, scaleValue, headNum, selectedBlockSize,
                  selectedBlockCount, mask, cq, ckv, mode, "TND", True, o, do, m, l, grad=True)
        outs = {
            "dqOut": _out("dqOut", dqOut, tuple(q.shape), q.dtype),
            "dkOut": _out("dkOut", dkOut, tuple(k.shape), k.dtype),
            "dvOut": _out("dvOut", dvOut, tuple(v.shape), v.dtype),
        }
        _same_device(query=q, **outs)
        ws = sum(_nbytes(t.shape, t.dtype) for t in (q, k, v))

        def call():
            return nsa.nsa_selected_attention_grad(
                q, k, v, o, do, m, l, topk, scale_value=scaleValue, selected_block_size=selectedBlockSize,
                selected_block_count=selectedBlockCount, head_num=headNum, actual_seq_qlen=cq,
                actual_seq_kvlen=ckv, atten_mask=mask, sparse_mode=mode, input_layout="TND",
                deterministic=None, backend="auto", validate=False,
            )

        def store(res):
            dq, dk, dv = res
            dqOut.copy_(dq)
            dkOut.copy_(dk)
            dvOut.copy_(dv)

        return _Runner(call, store, _NSA_NAMES, outs), ws, device

    return _phase1(api, build)


def aclnnNsaSelectedAttentionGrad(workspace, workspaceSize, executor, stream):  # noqa: N802, N803
    """Phase 2 of ``nsa_selected_attention_grad``. Returns a status."""
    return _phase2("aclnnNsaSelectedAttentionGrad", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------------------------------
# Runtime switches
# ----------------------------------------------------------------------------------------------------------------


def aclrtCtxSetSysParamOpt(opt, value) -> int:  # noqa: N802
    """``aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 1 | 0)``: NSA-grad determinism on/off, the same switch
    as :func:`sparseops.set_deterministic`. Returns ``ACL_SUCCESS`` (0), or ``ACL_ERROR_INVALID_PARAM``
    for another option or a value other than 0/1."""
    _tls.msg = None
    if isinstance(opt, bool) or opt != ACL_OPT_DETERMINISTIC:
        _tls.msg = f"aclrtCtxSetSysParamOpt: opt: only ACL_OPT_DETERMINISTIC ({ACL_OPT_DETERMINISTIC}) is supported, got {opt!r}"
        return ACL_ERROR_INVALID_PARAM
    if isinstance(value, bool) or value not in (0, 1):
        _tls.msg = f"aclrtCtxSetSysParamOpt: value: expected 0 or 1, got {value!r}"
        return ACL_ERROR_INVALID_PARAM
    _config.set_deterministic(bool(value))
    return ACL_SUCCESS


def aclrtCtxGetSysParamOpt(opt) -> tuple[int, int]:  # noqa: N802
    """``(status, value)`` of a switch set by :func:`aclrtCtxSetSysParamOpt`."""
    if isinstance(opt, bool) or opt != ACL_OPT_DETERMINISTIC:
        _tls.msg = f"aclrtCtxGetSysParamOpt: opt: only ACL_OPT_DETERMINISTIC ({ACL_OPT_DETERMINISTIC}) is supported, got {opt!r}"
        return ACL_ERROR_INVALID_PARAM, 0
    return ACL_SUCCESS, int(_config.is_deterministic())
