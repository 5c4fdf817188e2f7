"""The distributed executor on ranks > 0: serve one stage of the pipeline rank 0 starts.

``serve`` waits for rank 0's plan (``distributed.plan.Plan``), checks that this rank was given
the same pipeline, puts each module of its stage in the mode rank 0's has (``train()`` or
``eval()``: the pipeline's is rank 0's, as its weights are), takes rank 0's weights and runs ``worker_loop.run_stage`` until rank 0 closes the
pipeline; meanwhile it answers rank 0's control link (permits, snapshots, checkpoints, close).
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch
from torch import nn

from ...checkpoint.files import from_bytes, to_bytes
from ...core.stage import Stage, StageConfig
from ...errors import PipelineClosedError
from ...planning.partition import check_balance, split
from ..in_flight import resume, stage_answer
from ..messages import KIND_CHECKPOINT, KIND_CLOSE, KIND_PERMIT, KIND_SNAPSHOT, KIND_STATE, Message
from ..waiting import POLL_S, Aborted, wait
from ..worker_loop import Links, Sent, SentLog, Where, run_stage
from .link import Permits
from .plan import Plan, config_key, modes_of, state_specs, wires
from .ranks import Run


def serve(rank: int, model: nn.Sequential, config: StageConfig, threads: int) -> None:
    """Ranks > 0: run stage ``rank`` of the pipeline rank 0 starts, until rank 0 closes it.

    Returns at once if rank 0 closes the pipeline before its first sample; raises the run's
    failure (a ``StageError``) if any rank fails.
    """
    run = Run(rank, config.depth)
    health = run.health
    plan = run.wait_store("plan", health.check)
    if not isinstance(plan, Plan):
        if plan is not None:
            raise PipelineClosedError(f"rank 0 stopped before its first sample: {plan}")
        return
    try:
        check_balance(model, plan.balance)
        module = split(model, plan.balance)[rank]
        _check_plan(plan, rank, module, config)
        for name, training in plan.modes[rank]:
            module.get_submodule(name).training = training
    except ValueError as exc:
        health.fail(dict(stage=rank, sample=None, phase="start", message=str(exc), traceback=""))
        raise
    run.store.add(run.prefix + "ready", 1)
    origin = None if plan.random_state is None else torch.frombuffer(bytearray(plan.random_state), dtype=torch.uint8)
    config = replace(
        config,
        supervised=plan.config["supervised"],
        random_state=origin,
        first_trained=plan.first_trained,
        parameter_names=plan.parameter_names,
    )
    loaded, permits, ticks = threading.Event(), Permits(0), threading.Semaphore(0)
    granted = done = 0
    # Ungated in inference, a stage may be up to ``rank`` ticks ahead of the tick a checkpoint
    # is taken at: it notes what it sent in its last few ticks.
    sent = SentLog(config.depth + 1)
    stage: Stage | None = None

    def finish(ticks_offered: int) -> None:  # wait until this stage has run that many ticks
        nonlocal done
        while done < ticks_offered:
            wait(ticks, health.stop_check, spin_s=0)
            done += 1

    def control(message: Message) -> None:  # in the thread that receives rank 0's control link
        nonlocal granted
        if message.kind == KIND_STATE:
            module.load_state_dict(dict(zip((k for k, _ in plan.states[rank]), message.tensors)))
            loaded.set()
        elif message.kind == KIND_PERMIT and message.index > granted:
            permits.release(message.index - granted)
            granted = message.index
        elif message.kind == KIND_SNAPSHOT:
            finish(message.index)
            run.links[f"reply {rank}->0"].put(
                KIND_STATE, message.index, list(module.state_dict().values()), check=health.stop_check
            )
        elif message.kind == KIND_CHECKPOINT:
            finish(message.index)
            try:
                if stage is None:  # rank 0 asks only once every rank has started its stage
                    raise RuntimeError(f"rank {rank} was asked for a checkpoint before its stage started")
                answer = stage_answer(stage, sent.at(int(message.scalar) - 1) if message.scalar else Sent())
                run.publish(f"checkpoint {rank}", to_bytes(answer))
            except Exception as exc:  # this stage's failure, not the link's: every rank stops with it
                failed = Where()
                failed.phase = "checkpoint"
                health.stage_failed(failed, exc)
                raise Aborted from exc
            run.links[f"reply {rank}->0"].put(KIND_CHECKPOINT, message.index, check=health.stop_check)
        elif message.kind == KIND_CLOSE:
            health.closing = True

    before, where = torch.get_num_threads(), Where()
    try:
        run.connect(wires(plan, config.depth), control)
        while not loaded.wait(POLL_S):
            health.stop_check()
        torch.set_num_threads(threads)
        last = rank == config.depth - 1
        links = Links(
            index=rank,
            layout=plan.layout,
            act_in=run.links[f"activation {rank - 1}->{rank}"],
            act_out=run.link(f"activation {rank}->{rank + 1}"),
            grad_in=run.link(f"gradient {rank + 1}->{rank}"),
            grad_out=run.link(f"gradient {rank}->{rank - 1}"),
            targets=run.link("target") if last else None,
            results=run.link("result") if last else None,
            ticks=ticks,
            # Ungated in inference: no weight changes, so the weights between two ticks are
            # these whatever tick the stage is at, and no permit need travel per tick.
            permits=permits if config.learning else None,
        )
        stage = Stage(rank, module, config, run.device)
        first, tick = links, 0
        if plan.resumed:
            where.phase = "resume"
            state = from_bytes(run.store.get(run.prefix + f"resume {rank}"))
            first, tick = resume(stage, links, state)
        run_stage(stage, links, health.stop_check, where, sent, first=first, tick=tick)
    except Aborted:
        pass
    except BaseException as exc:  # noqa: BLE001 - published, then raised below
        health.stage_failed(where, exc)
    finally:
        torch.set_num_threads(before)
        run.close()
    if health.failure is not None:
        raise health.error()


def _check_plan(plan: Plan, rank: int, module: nn.Module, config: StageConfig) -> None:
    """A ValueError unless this rank was given the pipeline rank 0 was given."""
    ours, theirs = config_key(config), dict(plan.config)
    ours.pop("supervised"), theirs.pop("supervised")  # rank 0 alone sees the targets
    if ours != theirs:
        raise ValueError(
            f"rank {rank} was given another pipeline than rank 0: {ours} on rank {rank}, {theirs} on rank 0"
        )
    if state_specs(module) != plan.states[rank]:
        here, there = ([f"{k} {s}" for k, s in specs] for specs in (state_specs(module), plan.states[rank]))
        raise ValueError(
            f"stage {rank} of the model differs between rank {rank} and rank 0: {here} on rank {rank}, "
            f"{there} on rank 0"
        )
    names, theirs_names = [k for k, _ in modes_of(module)], [k for k, _ in plan.modes[rank]]
    if names != theirs_names:
        raise ValueError(
            f"stage {rank} of the model differs between rank {rank} and rank 0: modules {names} on rank {rank}, "
            f"{theirs_names} on rank 0"
        )
