"""Issue 33's trial as a new user would run it: train.py (beside this file) is a DeepSpeed script written from
docs/reliability.md alone, with the config's resume block and the drop-in's loader. Launched under
`torchrun --max-restarts 1` once uninterrupted, then 20 times with a random rank SIGKILLed after a random step: each
run must end with the uninterrupted run's weights, bit for bit, and each rank's resumed attempt must take exactly the
uninterrupted run's samples from the step it resumed at.

    python benchmarks/user_trial/run20.py [SEED]      # about 8 minutes on 2 cores
"""
import json, os, random, shutil, subprocess, sys, tempfile, time
PY = sys.executable
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
ROOT = tempfile.mkdtemp(prefix="zerokit-trial-")
def launch(out, kill=None):
    shutil.rmtree(out, ignore_errors=True); os.makedirs(out)
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if kill: env["TRY_KILL"] = kill
    started = time.time()
    done = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
                           SCRIPT, out], env=env, capture_output=True, text=True, timeout=300)
    return done, time.time() - started
def results(out):
    found = {}
    for name in os.listdir(out):
        if name.startswith("rank") and name.endswith(".json"):
            found[name] = json.load(open(os.path.join(out, name)))
    return found
done, _ = launch(f"{ROOT}/base")
assert done.returncode == 0, done.stderr[-3000:]
base = results(f"{ROOT}/base")
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
ok = 0
for trial in range(20):
    rank, step = rng.randrange(2), rng.randrange(1, 15)
    out = f"{ROOT}/t{trial}"
    done, seconds = launch(out, f"{rank}:{step}")
    got = results(out)
    finals = {k: v for k, v in got.items() if k.endswith("attempt1.json")}
    same = done.returncode == 0 and len(finals) == 2 and all(
        finals[f"rank{r}_attempt1.json"]["weights"] == base[f"rank{r}_attempt0.json"]["weights"] for r in range(2))
    # samples: the resumed attempt's samples are the uninterrupted run's tail after the resumed step
    resumed_from = (step // 4) * 4
    tails = all(finals[f"rank{r}_attempt1.json"]["seen"] == base[f"rank{r}_attempt0.json"]["seen"][resumed_from * 8:]
                for r in range(2)) if len(finals) == 2 else False
    ok += same and tails
    print(f"trial {trial}: kill rank {rank} after step {step}: rc {done.returncode}, bit-equal {same}, samples exact {tails}, {seconds:.1f} s", flush=True)
    if done.returncode != 0: print(done.stderr[-1500:])
print(f"{ok} of 20 ended bit-equal with every sample taken once")
