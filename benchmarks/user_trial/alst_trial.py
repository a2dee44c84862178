"""Issue 47's trial as a new user would run it: alst_tutorial.py (beside this file) is train.py from DeepSpeed's ALST
tutorial with its imports changed to zerokit's, on 4 CPU ranks (gloo) at sequence-parallel degree 4, ZeRO-3. Its
per-iteration losses are checked against one process training the same model on the full sequences with torch's
Adam in the same order (DeepSpeed's UlyssesSPDataLoaderAdapter hands every rank of a sequence group each rank's
micro-batch in turn: here each sample four times), and printed beside the same script on the real DeepSpeed (the
tutorial's own imports) where it is installed.

    python benchmarks/user_trial/alst_trial.py        # about a minute on 2 cores
"""
import json, os, subprocess, sys, tempfile
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS, DEGREE, RTOL = 4, 4, 1e-5


def tiny_random_llama(directory):
    """A stand-in for hf-internal-testing/tiny-random-LlamaForCausalLM (its shape; this machine is offline)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=16, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def launch(script, model, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(RANKS), script, model, out, str(DEGREE)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{done.stderr[-3000:]}")
    return [json.load(open(out.replace(".json", f".{rank}.json")))["losses"] for rank in range(RANKS)]


def one_process(model_dir, samples, repeats):
    """The reference: the whole sequences, torch's Adam (DeepSpeed's "Adam" at weight decay 0), one step each,
    clipped at 1.0 as DeepSpeed 0.19.8 clips a config without gradient_clipping (and the drop-in with it)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for tokens in samples:
        for _ in range(repeats):
            positions = torch.arange(tokens.numel()).unsqueeze(0)
            loss = model(input_ids=tokens.unsqueeze(0), position_ids=positions, labels=tokens.unsqueeze(0)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def deepspeed_script(root):
    """alst_tutorial.py with the tutorial's own imports back."""
    text = open(os.path.join(HERE, "alst_tutorial.py")).read().replace("zerokit.deepspeed", "deepspeed")
    path = os.path.join(root, "deepspeed_tutorial.py")
    open(path, "w").write(text)
    return path


def main():
    root = tempfile.mkdtemp(prefix="zerokit-alst-trial-")
    model = os.path.join(root, "model")
    tiny_random_llama(model)
    zerokit = launch(os.path.join(HERE, "alst_tutorial.py"), model, os.path.join(root, "zerokit.json"))
    if any(losses != zerokit[0] for losses in zerokit):
        raise SystemExit(f"the ranks' losses differ: {zerokit}")
    samples = torch.tensor([[1, 10, 10, 10, 2, 2, 7, 9], [1, 20, 20, 20, 2, 2, 5, 3]])
    reference = one_process(model, samples, repeats=DEGREE)
    try:
        import deepspeed  # noqa: F401
        real = launch(deepspeed_script(root), model, os.path.join(root, "deepspeed.json"))[0]
    except ImportError:
        real = [None] * len(reference)
    print(f"{'iteration':>9} {'one process':>12} {'zerokit':>12} {'DeepSpeed':>12}")
    for index, (ref, got, theirs) in enumerate(zip(reference, zerokit[0], real)):
        print(f"{index:>9} {ref:>12.6f} {got:>12.6f} {theirs if theirs is None else f'{theirs:12.6f}':>12}")
    worst = max(abs(got - ref) / abs(ref) for ref, got in zip(reference, zerokit[0]))
    print(f"zerokit against one process: largest relative difference {worst:.2e} (allowed {RTOL:g})")
    if len(zerokit[0]) != len(reference) or worst > RTOL:
        raise SystemExit("zerokit does not reproduce one process")


if __name__ == "__main__":
    main()
