"""The hardware catalogue: every entry sourced, overrides applied, and the planner free of torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zerokit.planner.catalogue import GPUS, HOSTS, LINKS, GiB, gpu, host, link, make_cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("entry", [*GPUS.values(), *LINKS.values(), *HOSTS.values()], ids=lambda e: e.key)
def test_every_entry_has_a_source(entry):
    assert len(entry.source) > 20


def test_required_entries_exist():
    assert {"nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "eth-100g", "eth-400g"} <= set(LINKS)
    assert {"a100-80gb", "h100-sxm", "h200"} <= set(GPUS)
    for entry in GPUS.values():  # a GPU's default links and host must exist
        link(entry.intra_link), link(entry.pcie), link(entry.inter_link), host(entry.host)


def test_a100_numbers():
    a100 = gpu("a100-80gb")
    assert a100.memory == 80 * GiB and a100.peak_flops["bf16"] == 312e12
    assert link("nvlink3").bandwidth == 300e9  # 600 GB/s bidirectional, per direction
    assert link("ib-ndr").bandwidth == 50e9  # 400 Gb/s


def test_user_numbers_override_the_catalogue_and_say_so():
    cluster = make_cluster("a100-80gb", intra_bandwidth=100e9, host_ram=64 * GiB, peak_tflops=100, nodes=2,
                           nics_per_node=2)
    assert cluster.intra_link.bandwidth == 100e9 and "user override" in cluster.intra_link.source
    assert cluster.host.ram == 64 * GiB and cluster.peak_flops("bf16") == 100e12
    assert cluster.inter_bandwidth_per_gpu == 25e9 * 2 / 8  # two HDR ports shared by eight GPUs


@pytest.mark.parametrize("call, message", [
    (lambda: gpu("tpu-v5"), "unknown GPU 'tpu-v5'; accepted: a100-40gb"),
    (lambda: link("carrier-pigeon"), "unknown link 'carrier-pigeon'; accepted: nvlink2"),
    (lambda: host("cray"), "unknown host 'cray'; accepted: dgx-a100"),
    (lambda: make_cluster("a100-80gb", nics_per_node=0), "nics per node=0 must be a positive integer"),
    (lambda: make_cluster("a100-80gb", peak_tflops=-1), "peak tflops=-1 must be > 0"),
])
def test_bad_catalogue_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _imports(path: Path) -> set[str]:
    """Top-level modules imported anywhere in the file (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def _module_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


PLANNER_FILES = sorted((ROOT / "zerokit" / "planner").glob("*.py")) + [ROOT / "zerokit" / "cli" / "plan.py",
                                                                      ROOT / "zerokit" / "cli" / "translate.py"]


@pytest.mark.parametrize("path", PLANNER_FILES, ids=lambda p: p.name)
def test_planner_imports_no_torch_and_matplotlib_only_lazily(path):
    assert "torch" not in _imports(path)
    assert "matplotlib" not in _module_level_imports(path)
    assert len(path.read_text().splitlines()) < 600
