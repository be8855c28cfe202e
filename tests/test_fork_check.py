"""Fork launching: CUDA initialised before a fork launch is refused in the parent with a message that
names the problem and the fixes; a process started by a launcher does not launch its ranks again.
(No child process: the checks run before anything would be forked.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_dist import DDP, Compressed, DiLoCo, Elastic
from lightning_dist.fork_safety import check_fork_safe
from lightning_dist.strategies.fork_launcher import ForkCheckedLauncher, checked_launcher


@pytest.fixture
def cuda_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


def test_fork_after_cuda_init_names_the_problem_and_the_fixes(cuda_initialised: None) -> None:
    with pytest.raises(RuntimeError) as info:
        check_fork_safe("fork", "DDP")
    message = str(info.value)
    assert message.startswith("DDP: CUDA was initialised in this process before a fork launch")
    assert "restart the kernel" in message
    assert "start_method='popen'" in message and "start_method='spawn'" in message


@pytest.mark.parametrize("start_method", ["popen", "spawn", "forkserver"])
def test_fresh_interpreters_and_cpu_ranks_pass(cuda_initialised: None, start_method: str) -> None:
    check_fork_safe(start_method, "DDP")
    check_fork_safe("fork", "DDP", uses_cuda=False)


def test_fork_passes_while_cuda_is_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    check_fork_safe("fork", "DDP")


def _trainer(strategy: object) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make", [lambda: DDP(start_method="fork"), lambda: Compressed("fp16", start_method="fork")]
)
def test_fork_launch_of_cuda_ranks_is_refused_before_forking(cuda_initialised: None, make: object) -> None:
    trainer = _trainer(make())  # type: ignore[operator]
    launcher = trainer.strategy.launcher
    assert isinstance(launcher, ForkCheckedLauncher)
    # the launch would fork GPU ranks (tests/conftest.py fails this test if anything is forked)
    trainer.strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(RuntimeError, match="CUDA was initialised in this process before a fork launch"):
        launcher.launch(lambda: None)


def test_other_start_methods_keep_lightnings_launchers() -> None:
    assert isinstance(_trainer(DDP(start_method="popen")).strategy.launcher, _SubprocessScriptLauncher)
    spawn = _trainer(DDP(start_method="spawn")).strategy.launcher
    assert type(spawn) is _MultiProcessingLauncher


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_no_second_launch_in_a_process_a_launcher_started(start_method: str) -> None:
    # torchrun's agent, run_elastic, SLURM, mpirun: the cluster environment created this process
    strategy = SimpleNamespace(cluster_environment=SimpleNamespace(creates_processes_externally=True))
    launcher = _MultiProcessingLauncher(strategy, start_method=start_method)  # type: ignore[arg-type]
    assert checked_launcher(strategy, launcher, "Elastic") is None
    strategy.cluster_environment.creates_processes_externally = False
    checked = checked_launcher(strategy, launcher, "Elastic")
    assert isinstance(checked, ForkCheckedLauncher) == (start_method == "fork")


def test_under_the_elastic_agent_fit_runs_in_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # what torch's elastic agent (torchrun, run_elastic) sets in each worker it starts
    env = {"TORCHELASTIC_RUN_ID": "t", "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for strategy in (DDP(start_method="fork"), Elastic(start_method="fork")):
        assert _trainer(strategy).strategy.launcher is None


def test_recovered_weights_are_loaded_onto_the_cpu(tmp_path: Any) -> None:
    """Rank 0's weights come back to the launching process on the CPU: loaded with the device they
    were saved on (CUDA on a GPU box), they would initialise CUDA there and fail the next fork launch."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
    from lightning.pytorch.trainer.states import TrainerState

    model = torch.nn.Linear(3, 2)
    path = tmp_path / "weights.ckpt"
    torch.save({k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}, path)
    strategy = DDP(start_method="fork")
    seen: list[Any] = []
    load = strategy.checkpoint_io.load_checkpoint

    def recording_load(p: Any, map_location: Any = None) -> Any:
        seen.append(map_location)
        return load(p, map_location=map_location)

    strategy.checkpoint_io.load_checkpoint = recording_load  # type: ignore[method-assign]
    launcher = ForkCheckedLauncher(strategy, "fork", "DDP")
    trainer = SimpleNamespace(
        lightning_module=model, checkpoint_callback=None, state=None, callback_metrics={}
    )
    launcher.update_main_process_results = lambda trainer, extra: None  # type: ignore[method-assign]
    launcher._recover_results_in_main_process(
        _WorkerOutput(None, str(path), TrainerState(), None, None), trainer
    )
    assert seen == ["cpu"]
    assert all(torch.equal(v, torch.full_like(v, 7.0)) for v in model.state_dict().values())
    assert not path.exists(), "the temporary weights file is removed"


FORKING = {
    "DDP": lambda: DDP(start_method="fork"),
    "Compressed": lambda: Compressed("int8", start_method="fork"),
    "DiLoCo": lambda: DiLoCo(inner_steps=2, start_method="fork"),
}
"""Every strategy that Lightning launches by fork from a notebook kernel."""


@pytest.mark.parametrize("name", sorted(FORKING))
def test_notebook_path_to_a_gpu_fork_launch_leaves_cuda_untouched(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A simulated 2-GPU box: seeding, building the workload's model, the Trainer with a CommMonitor and
    ``fit`` up to the fork launch must not initialise CUDA in the kernel (the model's RNG fork used to:
    ``fork_rng()`` reads every CUDA generator, so the first notebook fit on a GPU box failed)."""
    import lightning.fabric.accelerators.cuda as fabric_cuda

    from lightning_dist.callbacks import CommMonitor
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    def no_cuda_init() -> None:
        raise AssertionError("CUDA was initialised in the kernel")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda_init)
    monkeypatch.setattr(torch.cuda.random, "_lazy_init", no_cuda_init)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    launched: list[str] = []
    monkeypatch.setattr(
        _MultiProcessingLauncher, "launch", lambda self, *a, **k: launched.append(self._start_method)
    )

    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7))
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=2,
        strategy=FORKING[name](),
        max_steps=2,
        callbacks=[CommMonitor()],
    )
    trainer.fit(model)
    assert launched == ["fork"]


def a_notebook_cell_that_touches_cuda() -> None:
    torch.cuda.current_device()  # initialises CUDA (here, on a CPU build, it raises after the tracer ran)


def test_fork_error_names_the_call_that_first_initialised_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dist import fork_safety

    for module in (torch.cuda, torch.cuda.random, torch.cuda.memory):  # restored after the test
        monkeypatch.setattr(module, "_lazy_init", module._lazy_init)
    monkeypatch.setattr(fork_safety, "_first_cuda_init", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU box, CUDA untouched
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert fork_safety.trace_cuda_init() and fork_safety.trace_cuda_init(), "installs once, then reports it"
    assert fork_safety.first_cuda_init() is None
    with pytest.raises((AssertionError, RuntimeError)):
        a_notebook_cell_that_touches_cuda()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError) as info:
        check_fork_safe("fork", "DDP")
    message = str(info.value)
    assert "It was first initialised by this call:" in message
    assert "a_notebook_cell_that_touches_cuda" in message and "torch.cuda.current_device()" in message


def test_no_tracer_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dist import fork_safety

    monkeypatch.setattr(torch.cuda, "_lazy_init", torch.cuda._lazy_init)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.cuda._lazy_init
    assert fork_safety.trace_cuda_init() is False and torch.cuda._lazy_init is before


def test_run_elastic_refuses_to_fork_after_cuda_init_and_leaves_cuda_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed.launcher.api as launcher_api

    from lightning_dist.launch import run_elastic

    def no_cuda_init() -> None:
        raise AssertionError("CUDA was initialised in the kernel")

    started: list[str] = []
    monkeypatch.setattr(
        launcher_api,
        "elastic_launch",
        lambda config, fn: lambda *a: started.append(config.start_method) or {},
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda_init)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert run_elastic(print, 2, start_method="fork") == {} and started == ["fork"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="run_elastic: CUDA was initialised in this process before a fork"):
        run_elastic(print, 2, start_method="fork")
    assert run_elastic(print, 2, start_method="spawn") == {} and started == ["fork", "spawn"]


def cell_reading_every_rng() -> None:
    torch.cuda.get_rng_state_all()  # torch.cuda.random's own copy of _lazy_init


def cell_forking_the_rng() -> None:
    with torch.random.fork_rng(devices=[0, 1], device_type="cuda"):  # reads every GPU's generator
        pass


def cell_reading_the_seed() -> None:
    torch.cuda.initial_seed()


def cell_capping_memory() -> None:
    torch.cuda.set_per_process_memory_fraction(0.5)  # torch.cuda.memory's own copy of _lazy_init


CUDA_THROUGH_SUBMODULES = {
    "get_rng_state_all": (cell_reading_every_rng, "torch.cuda.get_rng_state_all()"),
    "fork_rng": (cell_forking_the_rng, "torch.random.fork_rng(devices=[0, 1]"),
    "initial_seed": (cell_reading_the_seed, "torch.cuda.initial_seed()"),
    "memory_fraction": (cell_capping_memory, "torch.cuda.set_per_process_memory_fraction(0.5)"),
}
"""Calls that initialise CUDA through ``torch.cuda.random``'s and ``torch.cuda.memory``'s by-name
imports of ``_lazy_init`` (not through ``torch.cuda._lazy_init``), and their line in the cell."""


@pytest.mark.parametrize("cause", sorted(CUDA_THROUGH_SUBMODULES))
def test_fork_error_names_a_cuda_init_through_torch_cuda_submodules(
    monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    """A faked 2-GPU box whose CUDA initialisation records that it ran: a notebook cell that reads the
    GPUs' RNG (the cause that broke the notebooks) or sets a memory cap is named in the fork error."""
    import lightning.fabric.accelerators.cuda as fabric_cuda

    from lightning_dist import fork_safety

    initialised: list[bool] = []

    def fake_lazy_init() -> None:  # torch's, on a GPU box: initialises CUDA (on this CPU build it raises)
        initialised.append(True)
        raise RuntimeError("fake CUDA initialised")

    for module in (torch.cuda, torch.cuda.random, torch.cuda.memory):  # each holds its own reference
        monkeypatch.setattr(module, "_lazy_init", fake_lazy_init)
    monkeypatch.setattr(fork_safety, "_first_cuda_init", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for module in (torch.cuda, torch.cuda.random):  # get_rng_state_all counts through its own copy
        monkeypatch.setattr(module, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(initialised))
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(fabric_cuda, "is_cuda_available", lambda: True)
    assert fork_safety.trace_cuda_init()
    cell, line = CUDA_THROUGH_SUBMODULES[cause]
    with pytest.raises(RuntimeError, match="fake CUDA initialised"):
        cell()
    assert initialised, "the cell reached CUDA's initialisation"
    with pytest.raises(RuntimeError) as info:
        check_fork_safe("fork", "DDP")
    message = str(info.value)
    assert "It was first initialised by this call:" in message, message
    assert cell.__name__ in message and line in message
    assert "fork_rng" in message and "get_rng_state" in message, "the usual causes include the RNG's"
