"""Worker functions for the roundpipe runtime tests (importable by spawned workers), and
the unpipelined loop they are compared with: the built-in GPT trained with AdamW, a
warm-up and cosine schedule, gradient accumulation over two calls and, where asked,
global clipping."""

from __future__ import annotations

import copy
from typing import Any

import torch
from settings import make_pipeline
from torch import nn
from training_cases import scheduler

import pipetrain
from pipetrain.app.models.gpt import build_gpt, gpt_loss, gpt_token_loss

LAYERS, CONTEXT, VOCAB, BATCH = 6, 8, 32, 8
UPDATES, ACCUMULATE, MAX_NORM, MICROBATCHES = 3, 2, 0.5, 4


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with an epsilon that keeps the keys' biases (whose gradients are float noise
    around zero: softmax ignores them) from turning that noise into steps of ``lr``."""
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01, eps=1e-4)


def gpt() -> nn.Sequential:
    """A small GPT (8 layers: embedding, 6 blocks, head), the same on every call."""
    torch.manual_seed(0)
    return build_gpt(d_model=16, heads=2, n_layers=LAYERS, context=CONTEXT, vocab=VOCAB)


def calls(updates: int = UPDATES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The token batches of every call, ``ACCUMULATE`` per update."""
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=generator),
            torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=generator),
        )
        for _ in range(updates * ACCUMULATE)
    ]


def reference_loop(clip: bool, updates: int = UPDATES) -> dict[str, Any]:
    """The unpipelined loop: every call's loss, the weights at the end and the logits of
    the first call's inputs then, in eval mode."""
    model = gpt()
    optimizer = adamw(model.parameters())
    schedule = scheduler(optimizer)
    losses, norms = [], []
    data = calls(updates)
    for update in range(updates):
        optimizer.zero_grad()
        for x, y in data[update * ACCUMULATE : (update + 1) * ACCUMULATE]:
            # the call's mean loss, its micro-batches' gradients added in the pipeline's order
            loss = torch.zeros(())
            for xs, ys in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES)):
                part = gpt_loss(model(xs), ys) * (len(xs) / len(x))
                part.backward()
                loss += part.detach()
            losses.append(loss.item())
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        evaluated = model(data[0][0])
    return {"losses": losses, "norms": norms, "state": model.state_dict(), "evaluated": evaluated}


def pipeline(
    clip: bool, weights: str | None = None, token_loss: bool = False, **settings: Any
) -> pipetrain.Pipeline:
    """The GPT on a pipeline with the loop's optimizer, schedule and clipping; with
    ``weights`` (a file of :func:`gpt`'s), built on the meta device and each stage read
    from there on its rank; with ``token_loss``, on ``(loss_sum, count)`` (the same mean:
    no target is ignored)."""
    if weights is None:
        model = gpt()
    else:
        with torch.device("meta"):
            model = build_gpt(d_model=16, heads=2, n_layers=LAYERS, context=CONTEXT, vocab=VOCAB)
        settings["weights"] = weights
    return make_pipeline(
        model,
        loss_fn=gpt_token_loss if token_loss else gpt_loss,
        optimizer=adamw,
        lr_scheduler=scheduler,
        max_grad_norm=MAX_NORM if clip else None,
        timeout_s=60,
        **settings,
    )


def train(
    pipe: pipetrain.Pipeline, start: int = 0, stop: int | None = None, explicit: bool = False
) -> list[float]:
    """The loop's calls from ``start`` to ``stop``, updating every ``ACCUMULATE``th (with
    ``explicit``, by ``pipe.update()`` after it instead)."""
    data = calls()
    stop = len(data) if stop is None else stop
    losses = []
    for k, (x, y) in enumerate(data[start:stop], start):
        last = k % ACCUMULATE == ACCUMULATE - 1
        losses.append(pipe.train_step(x, y, update=last and not explicit))
        if last and explicit:
            pipe.update()
    return losses


def private_storage(pipe: pipetrain.Pipeline) -> int:
    """Bytes of the parameters' storage outside the host store, between calls."""
    regions = [
        region.bytes
        for stored in pipe._rank.cycle._host.stages.values()
        for region in stored.regions()
    ]
    spans = [(r.data_ptr(), r.data_ptr() + r.numel()) for r in regions]
    outside = 0
    for parameter in pipe.parameters():
        pointer = parameter.data_ptr()
        if not any(start <= pointer < end for start, end in spans):
            outside += parameter.untyped_storage().nbytes()
    return outside


def roundpipe_loops(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loop on a roundpipe pipeline per config (``clip``, ``explicit`` updates and the
    pipeline's settings): every call's loss, the weights this rank holds at the end, the
    bytes of parameter storage outside the store, and (rank 0, first config) the last
    step's measured kinds."""
    results = []
    for index, config in enumerate(configs):
        settings = dict(config)
        clip, explicit = settings.pop("clip"), settings.pop("explicit", False)
        pipe = pipeline(clip, schedule="roundpipe", record=index == 0, **settings)
        losses = train(pipe, explicit=explicit)
        timeline = pipe.timeline() if index == 0 else None
        results.append(
            {
                "losses": losses,
                "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                "updates": pipe.updates,
                "private": private_storage(pipe),
                "kinds": None if timeline is None else [(e.kind, e.stage) for e in timeline.events],
                "evaluated": pipe.eval_step(calls()[0][0]),
            }
        )
    return results


SAVED_AT = 4  # calls: two updates


def saved_and_resumed(root: str, saving: dict[str, Any], loading: dict[str, Any]) -> dict[str, Any]:
    """The loop saved under ``root`` after ``SAVED_AT`` calls on a pipeline of ``saving``'s
    settings, then loaded into one of ``loading``'s and trained to the end: every call's
    loss and the weights this rank holds at the end."""
    first = pipeline(True, **saving)
    losses = train(first, 0, SAVED_AT)
    first.save(root)
    second = pipeline(True, **loading)
    found = second.load(root)
    losses += train(second, SAVED_AT)
    state = {k: v.clone() for k, v in second.state_dict().items()}
    return {"losses": losses, "state": state, "updates": second.updates, "found": found.updates}


def checkpoints_across_layouts(root: str) -> dict[str, dict[str, Any]]:
    """A roundpipe checkpoint continued on 1f1b, and a 1f1b one on roundpipe (with another
    cut), on two ranks."""
    roundpipe = {"schedule": "roundpipe", "microbatches": 4}
    return {
        "to_1f1b": saved_and_resumed(
            f"{root}/from-roundpipe",
            {**roundpipe, "schedule_options": {"model_stages": 4}},
            {"schedule": "1f1b", "microbatches": 4},
        ),
        "to_roundpipe": saved_and_resumed(
            f"{root}/from-1f1b",
            {"schedule": "1f1b", "microbatches": 4},
            {**roundpipe, "schedule_options": {"model_stages": 8, "resident": 1}},
        ),
    }


def resident_while_stored() -> dict[str, Any]:
    """In a fresh process (the test runner's allocator holds memory earlier tests freed): a
    64 MiB layer's resident set before it is stored, once stored, loaded, and offloaded
    after a backward, and whether its weight and gradient came back right."""
    from pipetrain.runtime.rank.host_store import resident_bytes
    from pipetrain.runtime.rank.stored_stage import StoredStage

    module = nn.Linear(4096, 4096, bias=False)  # 64 MiB of weights
    expected = module.weight.detach().clone()
    sizes = {"before": resident_bytes()}
    stored = StoredStage(0, module, torch.device("cpu"))
    sizes["stored"] = resident_bytes()
    stored.load()
    sizes["loaded"] = resident_bytes()
    module(torch.ones(1, 4096)).sum().backward()
    stored.offload()
    sizes["offloaded"] = resident_bytes()
    assert module.weight.grad is not None
    return {
        **sizes,
        "weight_kept": torch.equal(module.weight, expected),
        "gradient_right": torch.equal(module.weight.grad, torch.ones(4096, 4096)),
    }


def _peak_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def step_peaks() -> dict[str, Any]:
    """In a fresh process: a stored stage of four 16 MiB layers, its gradients in the store,
    stepped by Adam twice through the host store; the peak resident set over each step
    (the peak reset just before it), and whether the weights equal a plain Adam's."""
    from pipetrain.runtime.rank.host_store import resident_bytes
    from pipetrain.runtime.rank.stored_stage import HostWeights

    # one thread: the library's matrix products may split work over as many threads as
    # the machine's load allows, and another split rounds the gradients differently
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(4)))
    unstored = copy.deepcopy(model)  # the same layers, trained by a plain Adam
    reference = list(unstored.parameters())
    expected = torch.optim.Adam(reference, lr=0.01)
    host = HostWeights(torch.device("cpu"))
    host.adopt(0, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 2048)
    peaks = []
    for _ in range(2):
        host.load(0)
        model(x).square().sum().backward()
        host.offload(0)
        host.settle(optimizer)
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")  # the peak starts again from here
        before = resident_bytes()
        host.step(optimizer)
        peaks.append(_peak_bytes() - before)
        optimizer.zero_grad()
        expected.zero_grad()
        unstored(x).square().sum().backward()
        expected.step()
    return {
        "peaks": peaks,
        "exact": all(torch.equal(p, r) for p, r in zip(model.parameters(), reference)),
    }


def freed_blocks_return(trim: bool) -> int:
    """In a fresh process: the resident bytes that freeing 64 blocks of 1 MiB (each
    followed by a small tensor kept alive) gave back, after a freed 4 MiB block raised
    glibc's threshold for blocks mapped on their own; with ``trim``, after
    :func:`~pipetrain.distributed.heap.return_freed_memory` (keeping none free)."""
    from pipetrain.distributed.heap import return_freed_memory
    from pipetrain.runtime.rank.host_store import resident_bytes

    big = torch.ones(2**20)
    del big
    blocks, kept = [], []
    for _ in range(64):
        blocks.append(torch.ones(2**18))  # 1 MiB
        kept.append(torch.ones(16))
    held = resident_bytes()
    blocks.clear()
    if trim:
        assert return_freed_memory(kept=0)
    return held - resident_bytes()
