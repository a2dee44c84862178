"""Issue 45's trial as a new user would run it: cifar10_moe.py (beside this file) is DeepSpeedExamples'
training/cifar/cifar10_deepspeed.py (last changed in b965b9cd, unchanged at the snapshot 45b4b715) with its imports
changed to zerokit's, CIFAR-10 replaced by torchvision's FakeData of its shape (this machine is offline), a seed and a
losses file added. It is launched as the example's run_ds_moe.sh would be, with torchrun on 4 CPU ranks (gloo), the
experts split over expert groups of 2 (`--moe --ep-world-size 2 --num-experts 4 --top-k 1 --moe-param-group`), at
ZeRO 1, 2 and 3, for one epoch: 640 images, 40 steps of 16 (4 a rank), fp32 (`--dtype fp32`: DeepSpeed refuses the
script's default fp16 on a CPU). Every rank's losses are checked against one process taking DDP's step on the same
4 micro-batches (the script's Net with all 4 experts in one layer, ep_size 1, each micro-batch gated on its own
tokens with its rank's random numbers, torch's AdamW, clipping and the script's WarmupLR), and printed beside the same
script on the real DeepSpeed (its own imports back) at ZeRO 1 and 2 where it is installed; DeepSpeed's ZeRO 3, which
refuses its MoE, is run to show its message. The one process gates with the drop-in's MoE layer at ep 1
(tests/test_expert_dispatch.py checks its gate against DeepSpeed's, bit for bit where tokens may drop); DeepSpeed's
rows check it here as well.

torchvision does not import beside the main venv's torch 2.13.0, so the trial has a venv of its own:

    python3 -m venv /tmp/cifar_venv
    /tmp/cifar_venv/bin/pip install torch==2.14.1 torchvision==0.29.1   # from this machine's disk; 5.5 GB, runs on CPU
    /tmp/cifar_venv/bin/pip install -e . deepspeed==0.19.8              # DeepSpeed is optional
    /tmp/cifar_venv/bin/python benchmarks/user_trial/cifar10_moe_trial.py

About 2 minutes on 2 cores (DeepSpeed's first run in a new venv adds about 2 more, building its CPU Adam op).
"""
import argparse, importlib.util, json, os, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS, MICRO_BATCH, RTOL = 4, 4, 1e-5
FLAGS = ["--deepspeed", "--moe", "--ep-world-size", "2", "--num-experts", "4", "--top-k", "1", "--moe-param-group",
         "--dtype", "fp32", "--epochs", "1", "--log-interval", "10"]
DEEPSPEED_REFUSAL = "Native DeepSpeed MoE is not supported with ZeRO Stage 3"


def launch(script, stage, out, peer=False):
    """(each rank's losses, wall seconds, None), or (None, wall seconds, the error's last line) where the run fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")  # both on the CPU
    module = ["-m", "zerokit.testing.deepspeed_peer"] if peer else []  # DeepSpeed without its shm op build
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS), *module,
               script, *FLAGS, "--stage", str(stage), "--losses-out", out]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=os.path.dirname(out))
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error:" in line and "ChildFailedError" not in line]
        return None, seconds, errors[-1] if errors else done.stderr[-2000:]
    return [json.load(open(out.replace(".json", f".{rank}.json")))["losses"] for rank in range(RANKS)], seconds, None


def deepspeed_script(root):
    """cifar10_moe.py with the example's own imports back."""
    text = open(os.path.join(HERE, "cifar10_moe.py")).read().replace("zerokit.deepspeed", "deepspeed")
    path = os.path.join(root, "cifar10_deepspeed.py")
    open(path, "w").write(text)
    return path


def one_process(steps):
    """DDP's step in one process: rank r's micro-batches in DeepSpeed's loader order, each gated on its own tokens
    with rank r's generator (every rank seeded 0 before the model, then one draw as its loader starts), the mean of
    the 4 ranks' gradients clipped at 1.0, DeepSpeed's "Adam" (decoupled weight decay: torch's AdamW) at WarmupLR's
    log warm-up rate: 0 at its start and after its first step (iteration 0), so steps 0 and 1 at lr 0, step s > 0 at
    1e-3 * log(s) / log(1000)."""
    import math
    import torch
    from torch.utils.data import DataLoader, DistributedSampler
    sys.path.insert(0, HERE)
    sys.dont_write_bytecode = True  # no __pycache__ beside the trial
    import cifar10_moe as example
    arguments = argparse.Namespace(
        moe=True, num_experts=[4], ep_world_size=1, mlp_type="standard", top_k=1, min_capacity=0,
        noisy_gate_policy=None)
    torch.manual_seed(0)
    net = example.Net(arguments)  # its MoE layer is the drop-in's (zerokit's gate, DeepSpeed's numbers), at ep 1
    transform = example.transforms.Compose([example.transforms.ToTensor(),
                                            example.transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    dataset = example.torchvision.datasets.FakeData(size=640, image_size=(3, 32, 32), num_classes=10, random_offset=0,
                                                    transform=transform)
    start = torch.get_rng_state()
    loaders, generators = [], []
    for rank in range(RANKS):
        torch.set_rng_state(start)
        sampler = DistributedSampler(dataset, num_replicas=RANKS, rank=rank, shuffle=True, seed=0)
        loaders.append(iter(DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler)))
        generators.append(torch.get_rng_state())
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.0, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    criterion = torch.nn.CrossEntropyLoss()
    losses = [[] for _ in range(RANKS)]
    for step in range(steps):
        for rank in range(RANKS):
            torch.set_rng_state(generators[rank])
            images, labels = next(loaders[rank])
            loss = criterion(net(images), labels)
            (loss / RANKS).backward()
            losses[rank].append(loss.item())
            generators[rank] = torch.get_rng_state()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * math.log(max(step, 1)) / math.log(1000)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def worst(losses, reference):
    return max(abs(got - ref) / abs(ref) for mine, theirs in zip(losses, reference) for got, ref in zip(mine, theirs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the real DeepSpeed runs")
    options = parser.parse_args()
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # PyPI's torchvision beside torch 2.13.0 fails at import, not only when absent
        raise SystemExit(f"torchvision does not import here ({error}); make the venv in this file's docstring")
    engines = [("zerokit", os.path.join(HERE, "cifar10_moe.py"), False)]
    if importlib.util.find_spec("deepspeed") is not None and not options.no_deepspeed:
        engines.append(("DeepSpeed", None, True))  # its script is written into the run's folder
    root = tempfile.mkdtemp(prefix="zerokit-cifar10-moe-trial-")
    runs, seconds, refusals = {}, {}, {}
    for engine, script, peer in engines:
        script = script or deepspeed_script(root)
        for stage in (1, 2, 3):
            name = f"{engine} ZeRO {stage}"
            losses, seconds[name], error = launch(script, stage, os.path.join(root, f"{engine}{stage}.json"), peer)
            if losses is not None:
                runs[name] = losses
            elif engine == "DeepSpeed" and stage == 3 and DEEPSPEED_REFUSAL in error:
                refusals[name] = error
            else:
                raise SystemExit(f"{name} failed: {error}")
    steps = len(runs["zerokit ZeRO 1"][0])
    reference = one_process(steps)
    print(f"rank 0's losses ({steps} steps, {RANKS} ranks, 4 experts over expert groups of 2)")
    print(f"{'step':>4} {'one process':>12} " + " ".join(f"{name:>16}" for name in runs))
    for step in range(steps):
        print(f"{step:>4} {reference[0][step]:>12.6f} " + " ".join(f"{runs[name][0][step]:>16.6f}" for name in runs))
    print(f"largest relative difference over every rank and step (allowed {RTOL:g}), and wall time:")
    for name, losses in runs.items():
        zerokit = runs["zerokit" + name[len("DeepSpeed"):]] if name.startswith("DeepSpeed") else None
        beside = "" if zerokit is None else f", against zerokit's {worst(zerokit, losses):.2e}"
        print(f"  {name}: against one process {worst(losses, reference):.2e}{beside}; {seconds[name]:.1f} s")
    for name, error in refusals.items():
        print(f"  {name}: refused ({seconds[name]:.1f} s): {error.split(']: ')[-1]}")
    if any(worst(losses, reference) > RTOL for losses in runs.values()):
        raise SystemExit(f"a run does not reproduce one process within {RTOL:g}")


if __name__ == "__main__":
    main()
