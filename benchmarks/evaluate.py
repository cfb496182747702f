"""A speculative step's cost against a plain decode step, this tree's loop against an earlier revision's,
interleaved on the same prompts, and where this tree's step spends its time.

    python benchmarks/evaluate.py [--before bd45ad5] [--prompts 1] [--rounds 3] [--max-new-tokens 32]
                                  [--data data]

Each round decodes every prompt three ways from copies of one prefill, in a rotating order (a machine
that gets busier slows all three alike): the target alone, the speculative loop of `--before`
(src/dflashpipe/evaluate/speculative.py read through git) and this tree's. A step's cost is seconds per
verify step over seconds per plain decode token of the same prompt and round; speedup at a tau is
tau / that ratio. Needs a trained drafter, the target and the manifest under `--data` (`dvc repro train`).

`--parts` prices the pieces of a step against a plain decode step, interleaved in each round: the target's
decoder over 1, 2, 4 and 8 positions of a KV cache, its LM head over 1 and 7 rows and the drafter's draft of
1 and 7 slots, with every linear layer (target and drafter) in torch's form and in
dflashpipe.core.kernels.RowsFirstLinear's; then the whole step's cost and the speedup in each form (a verify
step is flat in its positions when its cost does not grow with them).

`--rows` times what a verify step's decoder spends most of its time in: the linear layers of every decoder
layer of --data's target, in order (the weights stream from memory as in a forward), over 1, 2, 4, 8 and 16
rows, in torch's form and RowsFirstLinear's, interleaved; each count's time over one row's in the same form
and round, and the float32 rate it reaches (a flat verify step needs 8 rows to cost about what 1 does).

`--draft-tokens 7,3,1` compares how many proposals a step verifies (evaluate.draft_tokens), in evaluate's
form (rows first), interleaved per prompt and round in a rotating order: each count's tau, step cost in plain
decode steps and speedup, and each speedup over the first count's on the same prompt and round.

`--threads budget,1,2` instead compares intra-op thread counts for this tree's loop, side by side in the
same rounds (`budget`: what dflashpipe.core.threads gives evaluate's one decoding thread, the process's
cores; a number: that many threads, torch's default being this machine's cores): each count's step cost
and speedup, and each count's step cost over the first's, per prompt and round. `--neighbour` runs a busy
process beside it (a matmul loop with torch's default threads).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def module_at(revision: str, path: str, name: str) -> types.ModuleType:
    """The module `path` as it was at `revision`, importable beside today's tree (same package imports)."""
    source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True)
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up there
    exec(compile(source.stdout, f"{revision}:{path}", "exec"), module.__dict__)
    return module


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f}, {len(values)} samples)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="bd45ad5", help="git revision whose loop is the 'before'")
    parser.add_argument("--prompts", type=int, default=1, help="per eval source")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--threads", help="e.g. budget,1,2: compare intra-op thread counts instead")
    parser.add_argument("--neighbour", action="store_true", help="a busy process beside the run")
    parser.add_argument("--parts", action="store_true", help="price a step's pieces, per linear layer form")
    parser.add_argument("--draft-tokens", help="e.g. 7,3,1: compare proposals verified per step")
    parser.add_argument("--rows", action="store_true", help="the decoder's linear layers over 1..16 rows")
    args = parser.parse_args()
    neighbour = None
    if args.neighbour:
        loop = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"
        neighbour = subprocess.Popen([sys.executable, "-c", loop])
    try:
        if args.parts:
            compare_parts(args)
        elif args.rows:
            compare_rows(args)
        elif args.draft_tokens:
            compare_draft_tokens(args)
        elif args.threads:
            compare_threads(args)
        else:
            compare_revisions(args)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def load(args):
    import torch

    from dflashpipe.evaluate.prompts import eval_prompts
    from dflashpipe.model import DFlashDrafter, TargetHead
    from dflashpipe.target.adapter import load_materialised_target, stop_token_ids
    from dflashpipe.target.chat import load_chat_tokenizer
    from dflashpipe.target.dtype import compute_dtype

    target = load_materialised_target(args.data / "target", "cpu", compute_dtype("cpu", "auto"))
    chat = load_chat_tokenizer(args.data / "target")
    drafter = DFlashDrafter.from_pretrained(
        args.data / "drafter", TargetHead.of(target), dtype=torch.float32, attention="sdpa"
    ).eval()
    prompts, _ = eval_prompts(args.data / "manifest", chat, args.prompts, 512)
    return target, drafter, prompts, stop_token_ids(target, chat.tokenizer)


def linear_forms(*modules):
    """torch's linear, and kernels.RowsFirstLinear; `use(name)` makes every linear layer of `modules` take it."""
    import torch

    from dflashpipe.core.kernels import RowsFirstLinear

    layers = [m for module in modules for m in module.modules() if isinstance(m, torch.nn.Linear)]
    forms = {"linear": torch.nn.Linear, "rows_first": RowsFirstLinear}

    def use(name: str) -> None:
        for layer in layers:
            layer.__class__ = forms[name]

    return list(forms), use


def compare_parts(args) -> None:
    import time

    import torch

    from dflashpipe.evaluate import speculative as loop
    from dflashpipe.target.adapter import Target

    model, drafter, prompts, stop = load(args)
    target, layers = Target(model), drafter.config.target_layer_ids
    forms, use = linear_forms(model, drafter)
    start = loop.prefill(target, prompts[0].prompt_ids, layers)
    proposer = loop.DFlashProposer(drafter)
    proposer.begin(start.features)
    cache, anchor = start.cache, start.first_token
    hidden = model.config.hidden_size

    def decode() -> None:
        target.decode_step(anchor.view(1, 1), cache)
        cache.crop(-1)

    def forward(n: int):
        def run() -> None:
            target.decoder_forward(anchor.view(1, 1).expand(1, n), cache)
            cache.crop(-n)

        return run

    def head(rows: int):
        return lambda: target.head(torch.randn(1, rows, hidden, dtype=target.dtype))

    parts = {f"decoder x{n}": forward(n) for n in (1, 2, 4, 8)}
    parts |= {"head x1": head(1), "head x7": head(7)}
    parts |= {"draft x1": lambda: proposer.draft(anchor, 1), "draft x7": lambda: proposer.draft(anchor, 7)}
    ratios = {(form, part): [] for form in forms for part in ["decode step", *parts]}
    with torch.no_grad():
        for round_ in range(args.rounds * 5 + 1):
            for form in forms if round_ % 2 else forms[::-1]:
                use(form)
                times = {}
                for name, run in {"decode step": decode, **parts}.items():
                    began = time.perf_counter()
                    run()
                    times[name] = time.perf_counter() - began
                if round_:  # the first round warms every path up
                    for name, seconds in times.items():
                        ratios[(form, name)].append(seconds / times["decode step"])
    print(f"pieces of a step over a plain decode step (same form, same round), {args.rounds * 5} rounds:")
    for part in parts:
        print(f"{part:12s} " + "; ".join(f"{form} {spread(ratios[(form, part)])}" for form in forms))
    cost, token_ms, step_ms = ({form: [] for form in forms} for _ in range(3))
    taus, speedup = [], {form: [] for form in forms}
    for round_ in range(args.rounds):
        for prompt in prompts:
            for form in forms if round_ % 2 else forms[::-1]:
                use(form)
                plain = loop.target_generate(target, loop.prefill(target, prompt.prompt_ids), args.max_new_tokens, stop)
                start = loop.prefill(target, prompt.prompt_ids, layers)
                fast = loop.speculative_generate(target, proposer, start, args.max_new_tokens, stop)
                assert fast.tokens == plain.tokens, prompt.sample_id  # lossless in either form
                if plain.decode_tokens:
                    per_token = plain.decode_s / plain.decode_tokens
                    token_ms[form].append(per_token * 1000)
                    step_ms[form].append(fast.decode_s / len(fast.produced) * 1000)
                    cost[form].append(fast.decode_s / len(fast.produced) / per_token)
                    speedup[form].append(plain.decode_s / fast.decode_s)
                    taus.append(fast.tau)
    print(f"{len(prompts)} prompts x {args.rounds} rounds, tau {spread(taus)}")
    for form in forms:
        print(
            f"{form:12s} plain decode ms/token {spread(token_ms[form])}; speculative ms/step {spread(step_ms[form])}; "
            f"step / plain decode step {spread(cost[form])}; speedup {spread(speedup[form])}"
        )
    first, last = forms[0], forms[-1]
    for name, values in (("plain decode ms/token", token_ms), ("speculative ms/step", step_ms)):
        ratio = [b / a for a, b in zip(values[first], values[last], strict=True)]
        print(f"{last} / {first}, {name} (same prompt and round): {spread(ratio)}")


def compare_rows(args, counts=(1, 2, 4, 8, 16), repeats=5) -> None:
    import time

    import torch

    from dflashpipe.core.kernels import RowsFirstLinear
    from dflashpipe.target.adapter import load_materialised_target
    from dflashpipe.target.dtype import compute_dtype

    model = load_materialised_target(args.data / "target", "cpu", compute_dtype("cpu", "auto"))
    # every decoder layer's: their weights stream from memory as in a forward (one layer's would sit in cache)
    layers = [m for m in model.get_decoder().layers.modules() if isinstance(m, torch.nn.Linear)]
    flops = {n: 2 * n * sum(m.weight.numel() for m in layers) for n in counts}
    forms = {"linear": torch.nn.Linear, "rows_first": RowsFirstLinear}
    inputs = {n: [torch.randn(n, m.in_features) for m in layers] for n in counts}
    seconds = {(form, n): [] for form in forms for n in counts}
    with torch.no_grad():
        for round_ in range(args.rounds * 5 + 1):
            for form in forms if round_ % 2 else list(forms)[::-1]:
                for m in layers:
                    m.__class__ = forms[form]
                for n in counts:
                    began = time.perf_counter()
                    for _ in range(repeats):
                        for m, x in zip(layers, inputs[n], strict=True):
                            m(x)
                    if round_:  # the first round warms every path up
                        seconds[(form, n)].append((time.perf_counter() - began) / repeats)
    shapes = ", ".join(f"{m.out_features}x{m.in_features}" for m in layers[:7])
    print(f"the decoder's {len(layers)} linear layers ({shapes}, ...), {args.rounds * 5} rounds of {repeats}:")
    for form in forms:
        for n in counts:
            ratio = [t / one for t, one in zip(seconds[(form, n)], seconds[(form, 1)], strict=True)]
            rate = flops[n] / statistics.median(seconds[(form, n)]) / 1e9
            print(
                f"{form:10s} {n:2d} rows: {statistics.median(seconds[(form, n)]) * 1e6:7.0f} us, "
                f"over 1 row {spread(ratio)}; {rate:.0f} GFLOPS"
            )


def compare_draft_tokens(args) -> None:
    from dflashpipe.core.kernels import rows_first
    from dflashpipe.evaluate import speculative as loop
    from dflashpipe.target.adapter import Target

    counts = [int(c) for c in args.draft_tokens.split(",")]
    model, drafter, prompts, stop = load(args)
    target, layers = Target(rows_first(model)), drafter.config.target_layer_ids
    proposer = loop.DFlashProposer(rows_first(drafter))
    loop.target_generate(target, loop.prefill(target, prompts[0].prompt_ids), 4, stop)  # first calls, untimed
    taus, cost, speedup = ({n: [] for n in counts} for _ in range(3))
    for round_ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            plain = loop.target_generate(target, loop.prefill(target, prompt.prompt_ids), args.max_new_tokens, stop)
            shift = (round_ + i) % len(counts)  # rotating order: a drift in load favours no count
            for n in counts[shift:] + counts[:shift]:
                start = loop.prefill(target, prompt.prompt_ids, layers)
                fast = loop.speculative_generate(target, proposer, start, args.max_new_tokens, stop, draft_tokens=n)
                assert fast.tokens == plain.tokens, prompt.sample_id  # lossless at every count
                if plain.decode_tokens:
                    per_token = plain.decode_s / plain.decode_tokens
                    taus[n].append(fast.tau)
                    cost[n].append(fast.decode_s / len(fast.produced) / per_token)
                    speedup[n].append(plain.decode_s / fast.decode_s)
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens, rows-first form")
    for n in counts:
        ratio = [a / b for a, b in zip(speedup[n], speedup[counts[0]], strict=True)]
        print(
            f"draft_tokens {n}: tau {spread(taus[n])}; step / plain decode step {spread(cost[n])}; "
            f"speedup {spread(speedup[n])}; over draft_tokens {counts[0]}'s {spread(ratio)}"
        )


def compare_threads(args) -> None:
    import torch

    from dflashpipe.core.threads import thread_budget
    from dflashpipe.evaluate import speculative as loop

    budget = thread_budget({"decode": 1})
    counts = [budget.threads["decode"] if c == "budget" else int(c) for c in args.threads.split(",")]
    names = [
        f"{c}={n}" if c == "budget" else f"{n} threads" for c, n in zip(args.threads.split(","), counts, strict=True)
    ]
    target, drafter, prompts, stop = load(args)
    layers = drafter.config.target_layer_ids

    def plain(ids):
        return loop.target_generate(target, loop.prefill(target, ids), args.max_new_tokens, stop)

    def spec(ids):
        start = loop.prefill(target, ids, layers)
        return loop.speculative_generate(target, loop.DFlashProposer(drafter), start, args.max_new_tokens, stop)

    torch.get_num_threads()
    for n in counts:  # first calls at every count in no measurement
        torch.set_num_threads(n)
        plain(prompts[0].prompt_ids), spec(prompts[0].prompt_ids)
    cost = {name: [] for name in names}
    speedup = {name: [] for name in names}
    per_token = {name: [] for name in names}
    for round_ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            shift = (round_ + i) % len(names)  # rotating order: a drift in load favours no count
            for k in list(range(shift, len(names))) + list(range(shift)):
                torch.set_num_threads(counts[k])
                base, fast = plain(prompt.prompt_ids), spec(prompt.prompt_ids)
                assert fast.tokens == base.tokens, prompt.sample_id  # lossless
                if base.decode_tokens == 0:
                    continue
                token_s = base.decode_s / base.decode_tokens
                per_token[names[k]].append(token_s * 1000)
                cost[names[k]].append(fast.decode_s / len(fast.produced) / token_s)
                speedup[names[k]].append(base.decode_s / fast.decode_s)
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens; budget {budget.to_json()}")
    for name in names:
        print(
            f"{name:14s} plain decode ms/token {spread(per_token[name])}; step / decode step {spread(cost[name])}; "
            f"speedup {spread(speedup[name])}"
        )
    first = names[0]
    for name in names[1:]:
        ratio = [a / b for a, b in zip(per_token[name], per_token[first], strict=True)]
        print(f"{name} / {first}: plain decode time per token {spread(ratio)}")


def compare_revisions(args) -> None:
    import torch

    from dflashpipe.evaluate import speculative as after
    from dflashpipe.evaluate.prompts import eval_prompts
    from dflashpipe.model import DFlashDrafter, TargetHead
    from dflashpipe.target.adapter import load_materialised_target, stop_token_ids
    from dflashpipe.target.chat import load_chat_tokenizer
    from dflashpipe.target.dtype import compute_dtype

    before = module_at(args.before, "src/dflashpipe/evaluate/speculative.py", "speculative_before")
    target = load_materialised_target(args.data / "target", "cpu", compute_dtype("cpu", "auto"))
    chat = load_chat_tokenizer(args.data / "target")
    drafter = DFlashDrafter.from_pretrained(
        args.data / "drafter", TargetHead.of(target), dtype=torch.float32, attention="sdpa"
    ).eval()
    layers = drafter.config.target_layer_ids
    prompts, _ = eval_prompts(args.data / "manifest", chat, args.prompts, 512)
    stop = stop_token_ids(target, chat.tokenizer)
    runs = {
        "target": lambda ids: after.target_generate(target, after.prefill(target, ids), args.max_new_tokens, stop),
        "before": lambda ids: before.speculative_generate(
            target, before.DFlashProposer(drafter), before.prefill(target, ids), args.max_new_tokens, stop
        ),
        "after": lambda ids: after.speculative_generate(
            target, after.DFlashProposer(drafter), after.prefill(target, ids, layers), args.max_new_tokens, stop
        ),
    }
    for run in runs.values():  # first calls (allocator, kernels) in no measurement
        run(prompts[0].prompt_ids)
    step_cost: dict[str, list[float]] = {"before": [], "after": []}
    speedup: dict[str, list[float]] = {"before": [], "after": []}
    taus = []
    order = list(runs)
    for round_ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            shift = (round_ + i) % len(order)
            done = {name: runs[name](prompt.prompt_ids) for name in order[shift:] + order[:shift]}
            plain = done["target"]
            if plain.decode_tokens == 0:
                continue
            per_token = plain.decode_s / plain.decode_tokens
            assert done["before"].tokens == done["after"].tokens == plain.tokens, prompt.sample_id  # lossless
            for name in ("before", "after"):
                step_cost[name].append(done[name].decode_s / len(done[name].produced) / per_token)
                speedup[name].append(plain.decode_s / done[name].decode_s)
            taus.append(done["after"].tau)
    ratio = [a / b for a, b in zip(step_cost["after"], step_cost["before"], strict=True)]
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens, tau {spread(taus)}")
    for name in ("before", "after"):
        print(
            f"{name:6s} ({args.before if name == 'before' else 'this tree'}): step / plain decode step "
            f"{spread(step_cost[name])}, speedup {spread(speedup[name])}"
        )
    print(f"after / before step cost (same prompt and round): {spread(ratio)}")

    totals = dict.fromkeys((*after.STEP_PARTS, "step"), 0.0)
    for prompt in prompts:
        profiled = after.speculative_generate(
            target,
            after.DFlashProposer(drafter),
            after.prefill(target, prompt.prompt_ids, layers),
            args.max_new_tokens,
            stop,
            profile=True,
        )
        for part, seconds in profiled.profile.items():
            totals[part] += seconds
    print(
        "where this tree's step goes: "
        + ", ".join(f"{part} {totals[part] / totals['step']:.1%}" for part in after.STEP_PARTS)
    )


if __name__ == "__main__":
    main()
