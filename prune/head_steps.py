"""A campaign's head step (prune.progressive; docs/design.md, The draft vocabulary): the drafter's head cut to
the next smaller draft vocabulary, judged as a layer step is.

The cut keeps the best-ranked of the ids the drafter proposes now (prune.vocab), at the largest size of
RunConfig.vocab_sizes below them. It is measured on the prompts that judge steps and taken when the stop
rules accept it: the retention floor against the unpruned tau, and the predicted speedup (decode.cost, the
head term of the campaign's timing) against the best so far. Nothing is healed: no weight changes, and no
training brings back an id the drafter cannot propose. A refused cut is no stop: the run takes a layer
step, and tries the head again before the next.
"""

from .state import RunState, StepRecord
from .vocab import cut_drafter, next_head_size


def head_step(ranking, sizes, current, state: RunState, judge, stop_rule, log):
    """(a copy of `current` with its head cut, its StepRecord) when `stop_rule` accepts the cut, else None (also
    when `ranking` is None or no size of `sizes` lies below the ids `current` proposes).

    Args:
        ranking: prune.vocab.TokenRanking of the ids to keep, or None.
        judge: callable(drafter) -> prune.scoring.Evaluation on the prompts that judge steps.
        stop_rule: callable(state, StepRecord) -> the rule the step breaks, or None.
        log: callable(message).
    """
    size = next_head_size(sizes, current)
    if ranking is None or size is None:
        return None
    step = len(state.history) + 1
    cut = cut_drafter(current, ranking, size)
    judged = judge(cut)
    record = StepRecord(step=step, folder=f"step-{step:02d}", removed=[], removed_original=[], layers=state.layers,
                        tau_before_heal=judged.tau, tau=judged.tau, retention=judged.tau / state.base.tau,
                        heal_rolled_back=False, heal_loss=[], scores=[], head_rows=size,
                        predicted_speedup=judged.predicted_speedup(state.timing.pass_times(state.layers, size)))
    refused = stop_rule(state, record)
    holding = f"{size} ids holding {cut.config.draft_vocab['coverage']:.2%} of the ranked tokens"
    if refused is not None:
        log(f"step {step}: a head of {holding} is not taken ({refused}); a layer step follows")
        return None
    log(f"step {step}: the head cut to {holding} keeps {record.retention:.2%} of the unpruned {state.judged_on} tau")
    return cut, record
