"""tltlib inside other trainers: TLT's adaptive rollout and online drafter behind TRL's ``GRPOTrainer(rollout_func=
...)`` (``tlt_rollout_func``). Importing this package does not import TRL; the first call checks its version."""
from .trl_checks import TRL_SUPPORTED, check_trl_version
from .trl_rollout import TLTRollout, tlt_rollout_func

__all__ = ["TLTRollout", "TRL_SUPPORTED", "check_trl_version", "tlt_rollout_func"]
