"""Converted models in PyTorch's training-at-scale and deployment machinery, on CPU: DDP, FSDP2 and FSDP1 over gloo
with two processes, activation checkpointing, torch.export (save/load in a fresh process) and checkpoints."""

import copy
import functools
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import TinyUNet, memory_order, train_unet, unet_batch

import tconv3d

TESTS = Path(__file__).parent
WORKER_TIMEOUT_S = 300


def converted_unet(**kwargs):
    torch.manual_seed(0)
    return tconv3d.nn.convert(TinyUNet(**kwargs))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, out_dir: Path, world_size: int = 2) -> list[dict]:
    """Start the ranks of tests/scale_worker.py, wait for them (killing all on a failure or past the timeout),
    and return what each rank saved. A run in which no rank failed on its own, only by a signal or past the
    deadline (the machine's doing: CI's 2-core VM once SIGKILLed a rank with nothing in its log), is run once
    more, with a warning; a rank that raises fails the test at once."""
    try:
        return _run_ranks_once(scenario, out_dir, world_size)
    except _KilledRanks as killed:
        warnings.warn(f"{scenario}: ranks killed, not failed; running once more:\n{killed}", stacklevel=1)
        retry = out_dir / "retry"
        retry.mkdir()
        try:
            return _run_ranks_once(scenario, retry, world_size)
        except _KilledRanks as again:
            pytest.fail(f"{scenario} failed twice:\n{again}")


class _KilledRanks(Exception):
    """Every failing rank of a run died by a signal or was killed past the deadline: none raised."""


def _run_ranks_once(scenario: str, out_dir: Path, world_size: int) -> list[dict]:
    port = _free_port()
    ranks, logs = [], [out_dir / f"rank{rank}.log" for rank in range(world_size)]
    # Inductor compiles in the rank's own process, not a pool of compile workers: CI (2 cores, 2026-11-27) once saw
    # ddp_compile's rank 0 run past the deadline after rank 1 had exited 0 (every collective done), and a worker
    # pool's shutdown is the suspect; two cores gain nothing from the pool either way.
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    for rank, log in enumerate(logs):  # output to files: an unread pipe could fill and stall a rank
        command = [sys.executable, str(TESTS / "scale_worker.py"), scenario, str(rank), str(world_size), str(port)]
        with open(log, "w") as out:
            ranks.append(subprocess.Popen([*command, str(out_dir)], stdout=out, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    killed = set()
    try:
        while any(p.poll() is None for p in ranks):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in ranks):
                break
            time.sleep(0.2)
    finally:
        for rank, p in enumerate(ranks):
            if p.poll() is None:
                killed.add(rank)
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in ranks):
        # Every rank's fate, the one that failed on its own first: a rank killed here only shows that another
        # failed or the deadline passed.
        why = f"past the {WORKER_TIMEOUT_S} s deadline" if time.monotonic() > deadline else "another rank failed"
        report = [
            f"rank {rank}: " + (f"killed by the test ({why})" if rank in killed else f"exited with {p.returncode}")
            + f"\n{log.read_text()[-3000:]}"
            for rank, (p, log) in sorted(enumerate(zip(ranks, logs, strict=True)), key=lambda r: r[0] in killed)
        ]  # fmt: skip
        if all(p.returncode < 0 or rank in killed for rank, p in enumerate(ranks) if p.returncode != 0):
            raise _KilledRanks("\n".join(report))
        pytest.fail(f"{scenario} failed:\n" + "\n".join(report))
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


def one_process_training() -> dict:
    """The same three steps as the ranks, on one process with the concatenated batch."""
    model = converted_unet()
    train_unet(model, *unet_batch(4))
    return model.state_dict()


needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


@pytest.mark.distributed
@needs_gloo
@pytest.mark.parametrize("scenario", ["ddp", "ddp_compile", "fsdp2", "fsdp1", "fsdp1_orig_params"])
def test_distributed_training_matches_one_process(scenario, tmp_path):
    results = run_ranks(scenario, tmp_path)
    expected = one_process_training()
    for rank, result in enumerate(results):
        assert result["state"].keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(result["state"][name], value, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        # Gradients in their parameters' exact strides: DDP neither warns nor copies them into its buckets.
        assert not [w for w in result["warnings"] if "Grad strides" in w], result["warnings"]
    copies = results[0]["copies"]
    print(f"{scenario}: weight-shaped copies in one step (count, bytes): {copies}")
    forward, _ = copies.get("forward layout", (0, 0))
    backward, _ = copies.get("backward layout", (0, 0))
    if scenario != "fsdp2":
        # channels_last_3d weights (FSDP1's views of its flat buffer keep their strides), gradients in their strides
        assert forward == backward == 0, copies
    else:
        # shardable's price, per step: at most one copy of each of the 4 conv weights in the forward, two in the
        # backward (see tconv3d.nn.shardable).
        assert forward <= 4 and backward <= 8, copies


def test_fully_shard_layout_of_shardable():
    """What fully_shard requires of every parameter (contiguity), and that the layers still compute the same."""
    model = converted_unet()
    x, _ = unet_batch(2)
    expected = model(x)
    tconv3d.nn.shardable(model)
    assert all(p.is_contiguous() for p in model.parameters())
    model.to(torch.float32)  # .to() keeps the layout the module was told to keep
    assert all(p.is_contiguous() for p in model.parameters())
    torch.testing.assert_close(model(x), expected)


def test_parameter_gradients_have_parameter_strides():
    """The 1x1x1 head's channels_last_3d weight and its gradient agree on every stride, size-1 dims included."""
    model = converted_unet()
    x, target = unet_batch(2)
    torch.nn.functional.mse_loss(model(x), target).backward()
    for name, p in model.named_parameters():
        assert p.grad.stride() == p.stride(), name
    tconv3d.nn.shardable(model)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), target).backward()
    for name, p in model.named_parameters():
        assert p.grad.stride() == p.stride(), name


# ---------------------------------------------------------------------------------------------------------------
# activation checkpointing


def _gradients(model, x, target, run=None):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.nn.functional.mse_loss((model if run is None else run)(x), target).backward()
    return {"input": x.grad, **{name: p.grad for name, p in model.named_parameters()}}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_same_gradients(compiled):
    plain, checkpointed = converted_unet(), converted_unet(checkpointed=True)
    checkpointed.load_state_dict(plain.state_dict())
    run = torch.compile(checkpointed, fullgraph=True) if compiled else checkpointed
    x, target = unet_batch(2)
    expected, got = _gradients(plain, x, target), _gradients(checkpointed, x, target, run)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# torch.export

LAYOUT_OPS = {"clone", "contiguous", "_to_copy", "copy", "copy_", "to", "permute", "transpose"}


def _export(model, x):
    return torch.export.export(model.eval(), (x,))


def test_export_graph_holds_tconv3d_ops():
    model = converted_unet()
    x, _ = unet_batch(1)
    program = _export(model, x)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert sum("tconv3d.conv3d." in t for t in targets) == 3  # stem, down, head
    assert sum("tconv3d.conv3d_input_grad" in t for t in targets) == 1  # the transposed conv
    assert sum("tconv3d.group_norm" in t for t in targets) == 2
    assert not [t for t in targets if "aten.conv" in t or "convolution" in t], targets
    assert not [t for t in targets if t.startswith("aten.") and t.split(".")[1] in LAYOUT_OPS], targets
    torch.testing.assert_close(program.module()(x), model(x))


FRESH_PROCESS = """
import sys, torch
if sys.argv[1] == "import":
    import tconv3d
program = torch.export.load(sys.argv[2])
torch.save(program.module()(torch.load(sys.argv[3])), sys.argv[4])
"""


def _fresh_process(*args, timeout=WORKER_TIMEOUT_S):
    return subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_export_save_load_in_fresh_process(tmp_path):
    model = converted_unet()
    x, _ = unet_batch(1)
    expected = model.eval()(x)
    torch.export.save(_export(model, x), tmp_path / "unet.pt2")
    torch.save(x, tmp_path / "x.pt")
    run = _fresh_process("import", tmp_path / "unet.pt2", tmp_path / "x.pt", tmp_path / "y.pt")
    assert run.returncode == 0, run.stderr[-4000:]
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected)
    # A process that has not imported tconv3d does not know its ops: loading fails and names them.
    run = _fresh_process("no-import", tmp_path / "unet.pt2", tmp_path / "x.pt", tmp_path / "y2.pt")
    assert run.returncode != 0 and "tconv3d" in run.stderr, run.stderr[-4000:]


AOTI_PROCESS = """
import sys, torch
try:  # before tconv3d is imported: its ops unknown
    torch._inductor.aoti_load_package(sys.argv[1])
except RuntimeError as error:
    print("refused:", error)
else:
    sys.exit("the package loaded where tconv3d was not imported")
import tconv3d
run = torch._inductor.aoti_load_package(sys.argv[1])
torch.save(run(torch.load(sys.argv[2])), sys.argv[3])
"""


AOTI_PROCESS_WITHOUT_TCONV3D = """
import sys, torch
run = torch._inductor.aoti_load_package(sys.argv[1])
torch.save(run(torch.load(sys.argv[2])), sys.argv[3])
assert "tconv3d" not in sys.modules
"""


@pytest.mark.parametrize("decomposed", [False, True], ids=["ops", "decomposed"])
def test_aot_inductor_package_runs_in_fresh_process(tmp_path, decomposed):
    """An AOTInductor package of a converted model (what an inference server loads) holds the ops as calls through
    the dispatcher (Inductor's proxy executor), not their kernels: in a fresh process it fails to load naming the
    op until tconv3d is imported, then runs. Made of the program decomposed by tconv3d.ops.decompositions(), it
    holds aten's ops alone, and runs where tconv3d is not imported."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # torch's own kinds of "no compiler"
        pytest.skip(f"AOTInductor compiles C++, and no C++ compiler was found: {error}")
    model = converted_unet()
    x, _ = unet_batch(1)
    with torch.no_grad():
        expected = model.eval()(x)
        program = _export(model, x)
        if decomposed:
            program = program.run_decompositions(tconv3d.ops.decompositions())
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "unet.pt2"))
    torch.save(x, tmp_path / "x.pt")
    run = subprocess.run(
        [sys.executable, "-c", AOTI_PROCESS_WITHOUT_TCONV3D if decomposed else AOTI_PROCESS, package,
         tmp_path / "x.pt", tmp_path / "y.pt"],
        capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    if not decomposed:
        assert "refused:" in run.stdout and "tconv3d::conv3d" in run.stdout, run.stdout[-4000:]
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected)


# ---------------------------------------------------------------------------------------------------------------
# checkpoints


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().flatten().view(torch.uint8)  # in logical order, whatever the layout


def test_state_dict_round_trip_is_exact():
    torch.manual_seed(0)
    stock = TinyUNet()
    converted = tconv3d.nn.convert(TinyUNet())
    converted.load_state_dict(stock.state_dict())
    back = TinyUNet()
    back.load_state_dict(converted.state_dict())
    for source in (converted.state_dict(), back.state_dict()):
        assert source.keys() == stock.state_dict().keys()
        for name, value in stock.state_dict().items():
            assert torch.equal(_bits(source[name]), _bits(value)), name


WHOLE_MODEL = """
import sys, torch
model = torch.load(sys.argv[1], weights_only=False)
torch.save(model(torch.load(sys.argv[2])), sys.argv[3])
"""


@pytest.mark.parametrize("shardable", [False, True], ids=["channels_last", "shardable"])
def test_whole_converted_model_loads_in_fresh_process(tmp_path, shardable):
    model = converted_unet()
    if shardable:
        tconv3d.nn.shardable(model)
    x, _ = unet_batch(1)
    torch.save(model, tmp_path / "model.pt")
    torch.save(x, tmp_path / "x.pt")
    run = subprocess.run(
        [sys.executable, "-c", WHOLE_MODEL, tmp_path / "model.pt", tmp_path / "x.pt", tmp_path / "y.pt"],
        capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(TESTS)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), model(x))


def _train_steps(model, optimizer, steps: int) -> None:
    train_unet(model, *unet_batch(2), steps=steps, optimizer=optimizer)


def _save_checkpoint(kind: str, model, optimizer, path: Path) -> None:
    if kind == "torch_save":
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    elif kind == "distributed_checkpoint":
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, moments = get_state_dict(model, optimizer)
        save({"model": weights, "optimizer": moments}, checkpoint_id=path)
    else:  # safetensors for the weights (its save_model packs them contiguous), torch.save for the optimizer
        from safetensors.torch import save_model

        save_model(model, str(path) + ".safetensors")
        torch.save(optimizer.state_dict(), str(path) + ".optimizer")


def _load_checkpoint(kind: str, model, optimizer, path: Path) -> None:
    """Load the checkpoint into model and, unless None, optimizer."""
    if kind == "torch_save":
        state = torch.load(path)
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    elif kind == "distributed_checkpoint":  # loads in place into the state dicts' tensors
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        weights, moments = get_state_dict(model, optimizer or [])
        load({"model": weights, **({"optimizer": moments} if optimizer else {})}, checkpoint_id=path)
        set_state_dict(model, optimizer or [], model_state_dict=weights, optim_state_dict=moments)
    else:
        from safetensors.torch import load_model

        load_model(model, str(path) + ".safetensors")
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(str(path) + ".optimizer"))


@pytest.mark.parametrize("kind", ["torch_save", "distributed_checkpoint", "safetensors"])
def test_training_resumes_from_a_checkpoint(kind, tmp_path):
    """Training stopped after 2 AdamW steps, checkpointed (weights and optimizer) in a format users save in, loaded
    into a fresh converted model (other weights) and a fresh optimizer, and trained 2 steps more ends where 4 steps
    without a stop end, bit for bit. The loaded conv weights and their optimizer moments are channels_last_3d, as
    the uninterrupted run's; the checkpoint loads into the stock model too, the same values."""
    if kind == "safetensors":
        pytest.importorskip("safetensors")
    checkpoint = tmp_path / "checkpoint"
    with warnings.catch_warnings():  # the distributed checkpoint's "assuming the intent is ... a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        stopped = converted_unet()
        optimizer = torch.optim.AdamW(stopped.parameters(), lr=0.01)
        _train_steps(stopped, optimizer, 2)
        _save_checkpoint(kind, stopped, optimizer, checkpoint)
        torch.manual_seed(1)
        resumed, stock = tconv3d.nn.convert(TinyUNet()), TinyUNet()
        assert not torch.equal(resumed.stem[0].weight, stopped.stem[0].weight)
        optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.01)
        _load_checkpoint(kind, resumed, optimizer, checkpoint)
        _load_checkpoint(kind, stock, None, checkpoint)
    for name, value in stopped.state_dict().items():
        assert torch.equal(stock.state_dict()[name], value), name
    for conv in (m for m in resumed.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)):
        moments = optimizer.state[conv.weight]
        for t in (conv.weight, moments["exp_avg"], moments["exp_avg_sq"]):
            assert t.is_contiguous(memory_format=torch.channels_last_3d) and t.stride() == conv.weight.stride(), conv
    _train_steps(resumed, optimizer, 2)
    for (name, ours), theirs in zip(resumed.named_parameters(), _uninterrupted_training(), strict=True):
        assert torch.equal(ours, theirs), name


@functools.cache
def _uninterrupted_training() -> list[torch.Tensor]:
    """The parameters of converted_unet() after 4 AdamW steps."""
    model = converted_unet()
    _train_steps(model, torch.optim.AdamW(model.parameters(), lr=0.01), 4)
    return [p.detach() for p in model.parameters()]


OPTIMIZERS = {
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=0.01, **kw),
    "sgd": lambda params, **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, **kw),
    "adagrad": lambda params, **kw: torch.optim.Adagrad(params, lr=0.1, **kw),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("made", ["stock_checkpoint", "before_convert", "converted_checkpoint"])
def test_fused_optimizers_step_right_on_state_made_in_another_layout(kind, made):
    """Optimizer state made in one layout, met by weights in the other: a stock run's checkpoint (NCDHW moments)
    loaded into a converted model's fresh fused optimizer (match_optimizer_state called before the load: its hook
    lays the loaded state out); steps on the stock model before converting it in place (called after `convert`);
    a converted run's checkpoint (channels_last_3d moments) loaded into the stock model's optimizer. The state then
    has its weights' order, and a fused step ends where the for-loop step ends from the same state (torch's CPU
    fused optimizers pair elements by memory position: without the match they answer wrongly,
    docs/upstream.md)."""
    build = OPTIMIZERS[kind]
    torch.manual_seed(0)
    source = converted_unet() if made == "converted_checkpoint" else TinyUNet()
    source_optimizer = build(source.parameters(), fused=True)
    _train_steps(source, source_optimizer, 2)
    ends = []
    for fused in (True, False):
        checkpoint = copy.deepcopy(source_optimizer.state_dict())
        for group in checkpoint["param_groups"]:  # a checkpoint's groups replace the optimizer's, their flags too
            group.update(fused=fused, foreach=False)
        if made == "before_convert":
            model = copy.deepcopy(source)
            optimizer = build(model.parameters())
            optimizer.load_state_dict(checkpoint)
            tconv3d.nn.match_optimizer_state(optimizer)  # nothing to match yet: the weights are NCDHW as the state
            tconv3d.nn.convert(model)
            tconv3d.nn.match_optimizer_state(optimizer)
        else:
            model = TinyUNet() if made == "converted_checkpoint" else converted_unet()
            model.load_state_dict(source.state_dict())
            optimizer = tconv3d.nn.match_optimizer_state(build(model.parameters()))
            optimizer.load_state_dict(checkpoint)
        assert all(group["fused"] is fused for group in optimizer.param_groups)
        for conv in (m for m in model.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)):
            assert conv.weight.is_contiguous(
                memory_format=torch.contiguous_format if made == "converted_checkpoint" else torch.channels_last_3d
            )
            for value in optimizer.state[conv.weight].values():
                assert value.dim() == 0 or memory_order(value) == memory_order(conv.weight), (conv, value.stride())
        _train_steps(model, optimizer, 1)
        ends.append(list(model.parameters()))
    for fused, loop in zip(*ends, strict=True):
        torch.testing.assert_close(fused, loop)


def test_lbfgs_runs_after_shardable():
    """torch's LBFGS flattens every gradient with view(-1), which a channels_last_3d one refuses; after `shardable`
    (contiguous weights) it runs on a converted model and ends where it ends on the stock one."""
    x, target = unet_batch(2)
    torch.manual_seed(0)
    stock = TinyUNet()
    initial = stock.stem[0].weight.detach().clone()
    converted = tconv3d.nn.shardable(converted_unet())
    for model in (stock, converted):
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5)

        def loss(model=model, optimizer=optimizer):
            optimizer.zero_grad()
            value = torch.nn.functional.mse_loss(model(x), target)
            value.backward()
            return value

        optimizer.step(loss)
    assert not torch.equal(stock.stem[0].weight, initial)
    for ours, theirs in zip(converted.parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)
