"""CANN's two-phase ``aclnn`` API over the sparseops Python ops (docs/aclnn.md).

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
  copying them into the out tensors.

Status codes: :data:`ACLNN_SUCCESS`, :data:`ACLNN_ERR_PARAM_NULLPTR` (a required tensor or out tensor is
None), :data:`ACLNN_ERR_PARAM_INVALID` (unsupported dtype / format / layout, float64, int64 index tensors,
a bad executor, workspace or stream), :data:`ACLNN_ERR_INNER_TILING_ERROR` (a shape or attribute
constraint, anything else the Python op rejects), :data:`ACLNN_ERR_RUNTIME_ERROR` (an unexpected failure
while computing).

The runtime (:mod:`.runtime`) is shared; each op family is one module (:mod:`.moe`, :mod:`.nsa`).
"""

from .moe import (
    aclnnMoeTokenPermuteWithEp,
    aclnnMoeTokenPermuteWithEpGetWorkspaceSize,
    aclnnMoeTokenPermuteWithEpGrad,
    aclnnMoeTokenPermuteWithEpGradGetWorkspaceSize,
    aclnnMoeTokenUnpermuteWithEp,
    aclnnMoeTokenUnpermuteWithEpGetWorkspaceSize,
    aclnnMoeTokenUnpermuteWithEpGrad,
    aclnnMoeTokenUnpermuteWithEpGradGetWorkspaceSize,
)
from .nsa import (
    aclnnNsaSelectedAttention,
    aclnnNsaSelectedAttentionGetWorkspaceSize,
    aclnnNsaSelectedAttentionGrad,
    aclnnNsaSelectedAttentionGradGetWorkspaceSize,
)
from .runtime import (
    ACL_ERROR_INVALID_PARAM,
    ACL_OPT_DETERMINISTIC,
    ACL_SUCCESS,
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    ACLNN_SUCCESS,
    AclOpExecutor,
    aclGetRecentErrMsg,
    aclrtCtxGetSysParamOpt,
    aclrtCtxSetSysParamOpt,
)

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
