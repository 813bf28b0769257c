"""Training on the toy config: it learns, it is reproducible, it resumes after
SIGKILL, it runs under DDP on CPU, and config mistakes are clear errors."""

import csv
import json
import math
import os
import shutil
import signal
import subprocess

import pytest
import torch
from conftest import ROOT, TOY, metrics, mt_cmd, run_command, train_args, wait_for
from safetensors.torch import load_file

from mt.cli.main import main
from mt.config import load_config
from mt.data.batches import TokenBatchSampler, TranslationDataModule
from mt.decode.fastpath import speed_up
from mt.decode.inference import load
from mt.decode.translator import Translator
from mt.model.transformer import Transformer
from mt.train.checkpoints import average_checkpoints, step_checkpoints, validation_loss
from mt.train.ema import KEY as EMA_KEY
from mt.train.ema import WeightEMA, ema_rate
from mt.train.lit import inverse_sqrt, timed_cooldown
from mt.train.run import resolve_precision


def test_toy_model_learns(toy_run):
    best = max(float(m["val_bleu"]) for m in metrics(toy_run))
    assert best > 80.0
    for name in ("config.yaml", "model.safetensors", "model.json", "spm.model", "checkpoints/best.ckpt"):
        assert (toy_run / name).exists()


def test_gradient_norm_is_logged_before_clipping(toy_run):
    with open(next((toy_run / "logs").glob("version_*")) / "metrics.csv") as f:
        norms = [float(r["grad_norm"]) for r in csv.DictReader(f) if r.get("grad_norm")]
    t = load_config(TOY).train
    assert len(norms) == t.max_steps // t.log_every_steps
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert 0 < t.clip_grad_norm < max(norms)  # early toy gradients exceed the clip: the norm is taken before clipping


def test_tensorboard_shows_the_losses_bleu_and_learning_rate(toy_run):
    """The TensorBoard events hold what the CSV log holds: read back with TensorBoard's own reader."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        if os.environ.get("MT_REQUIRE_EXTRAS") == "1":
            raise
        pytest.skip("the tensorboard extra: pip install -e '.[tensorboard]'")
    (events,) = (toy_run / "tb").glob("version_*")
    tb = EventAccumulator(str(events))
    tb.Reload()
    scalars = {tag: [e.value for e in tb.Scalars(tag)] for tag in tb.Tags()["scalars"]}
    for tag in ("train_loss", "val_loss", "val_bleu", "lr-AdamW", "grad_norm"):
        assert scalars.get(tag), (tag, sorted(scalars))
    csv_bleu = [float(m["val_bleu"]) for m in metrics(toy_run) if m.get("val_bleu")]
    assert scalars["val_bleu"] == pytest.approx(csv_bleu, abs=1e-4)
    assert max(scalars["lr-AdamW"]) > min(scalars["lr-AdamW"]) > 0  # warmup then decay


def test_toy_model_learns_with_rdrop(toy_data, tmp_path):
    """R-Drop runs each batch twice: half the batch keeps a step's cost. With half the sentences per
    update the toy reaches ~70 BLEU in its 600 updates (and rising) rather than the plain run's > 80."""
    run = tmp_path / "rdrop"
    rdrop = ("train.rdrop_alpha=5", "data.max_tokens=1024", "train.val_every_steps=100")
    assert main(train_args(toy_data, run, *rdrop)) == 0
    bleus = [float(m["val_bleu"]) for m in metrics(run)]
    assert bleus[0] < 20.0 and bleus[-1] > 50.0
    with open(run / "logs" / "version_0" / "metrics.csv") as f:
        kls = [float(r["rdrop_kl"]) for r in csv.DictReader(f) if r.get("rdrop_kl")]
    assert len(kls) == load_config(TOY).train.max_steps // load_config(TOY).train.log_every_steps
    assert all(0 < k < 1 for k in kls)  # positive (dropout makes the passes differ), and far below the loss


def test_schedule_warms_up_decays_and_cools_down():
    plain, cooled = inverse_sqrt(warmup=100), inverse_sqrt(warmup=100, cooldown=200, total=1000)
    rates = [plain(i) for i in range(1000)]  # factor(i) sets the rate of update i + 1
    assert rates[0] == pytest.approx(0.01) and rates[99] == pytest.approx(1.0)
    assert rates[399] == pytest.approx(0.5)  # 1/sqrt(step) after warmup: a quarter of the way, half the rate
    assert all(a < b for a, b in zip(rates[:99], rates[1:100])) and all(a > b for a, b in zip(rates[99:], rates[100:]))
    assert [cooled(i) for i in range(800)] == rates[:800]  # identical until the cooldown starts
    assert cooled(899) == pytest.approx(rates[899] * 101 / 200)  # linear: halfway down at its middle
    assert cooled(999) == pytest.approx(rates[999] / 200) and cooled(1000) == 0.0


def test_training_follows_the_cooldown(toy_data, tmp_path):
    args = ("train.max_steps=40", "train.warmup_steps=10", "train.cooldown_steps=20", "train.log_every_steps=10")
    assert main(train_args(toy_data, tmp_path / "r", *args, "train.val_every_steps=20")) == 0
    with open(tmp_path / "r" / "logs" / "version_0" / "metrics.csv") as f:
        lrs = [float(r["lr-AdamW"]) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    peak, plain = load_config(TOY).train.lr, inverse_sqrt(10)
    assert len(lrs) == 4 and lrs[1] == pytest.approx(peak * plain(19))  # before the cooldown: 1/sqrt(step)
    assert lrs[3] < peak * plain(39) / 5  # near the end: most of the way down to 0


def test_timed_cooldown_follows_the_clock():
    """train.cooldown_minutes: the update schedule until the last minutes of the budget, then linearly to 0."""
    left = [600.0]  # seconds of the budget left
    plain = inverse_sqrt(warmup=100)
    cooled = timed_cooldown(plain, lambda: left[0], window=120.0)
    assert [cooled(i) for i in range(0, 1000, 7)] == [plain(i) for i in range(0, 1000, 7)]  # long before the window
    for seconds, share in ((120.0, 1.0), (90.0, 0.75), (30.0, 0.25), (0.0, 0.0), (-5.0, 0.0)):
        left[0] = seconds
        assert cooled(500) == pytest.approx(plain(500) * share)


def test_training_cools_down_by_the_clock(toy_data, tmp_path):
    """A run bounded by time follows the update schedule, then ends its budget with its rate near 0."""
    args = ("train.max_steps=-1", "train.max_epochs=1000", "train.max_minutes=0.25", "train.cooldown_minutes=0.1")
    assert main(train_args(toy_data, tmp_path / "r", *args, "train.log_every_steps=1")) == 0
    with open(tmp_path / "r" / "logs" / "version_0" / "metrics.csv") as f:
        rates = [(int(r["step"]), float(r["lr-AdamW"])) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    peak, plain = load_config(TOY).train.lr, inverse_sqrt(load_config(TOY).train.warmup_steps)
    (first, first_rate), (last, last_rate) = rates[0], rates[-1]
    assert first_rate == pytest.approx(peak * plain(first))  # seconds before the last 6 of the 15
    assert last_rate < 0.25 * peak * plain(last)  # the last update's rate, in the last seconds


def test_a_cooldown_by_the_clock_is_refused_for_several_processes(toy_data, tmp_path, capsys):
    """Each process's clock would set its own rate, and the replicas would drift apart."""
    several = ("trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp")
    timed = ("train.max_steps=-1", "train.max_minutes=1", "train.cooldown_minutes=0.5")
    assert main(train_args(toy_data, tmp_path / "r", *several, *timed)) == 1
    assert "train.cooldown_minutes: needs a single-process run" in capsys.readouterr().err


def test_moving_average_of_the_weights():
    """ema = d * ema + (1 - d) * weights after each optimizer update, d warming up to the decay;
    an update-less step (accumulating gradients) changes nothing; a checkpoint carries it."""
    from types import SimpleNamespace

    module = torch.nn.Linear(3, 2)
    trainer = SimpleNamespace(global_step=0)
    ema = WeightEMA(0.9)
    ema.on_train_start(trainer, module)
    expected = {n: t.clone() for n, t in module.state_dict().items()}
    for step in range(1, 30):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p))  # the optimizer's update, in place
        trainer.global_step = step
        ema.on_train_batch_end(trainer, module, None, None, step)
        ema.on_train_batch_end(trainer, module, None, None, step)  # no new update: no change
        d = ema_rate(0.9, step)
        for n, t in module.state_dict().items():
            expected[n] = d * expected[n] + (1 - d) * t
    assert ema_rate(0.9, 1) == pytest.approx(2 / 11) and ema_rate(0.9, 1000) == 0.9
    assert all(torch.allclose(ema.state_dict_[n], expected[n], atol=1e-6) for n in expected)
    checkpoint = {}
    ema.on_save_checkpoint(trainer, module, checkpoint)
    resumed = WeightEMA(0.9)
    resumed.on_load_checkpoint(trainer, module, checkpoint)
    resumed.on_train_start(trainer, module)
    assert resumed.updates == 29
    assert all(torch.equal(resumed.state_dict_[n], ema.state_dict_[n]) for n in expected)


def test_moving_average_is_the_inference_model_and_resumes_exactly(toy_data, tmp_path, capsys):
    """train.ema_decay: the run exports the moving average its newest checkpoint holds; a run
    stopped and resumed exports the same weights; mt average switches between it and the checkpoints."""
    opts = ("train.ema_decay=0.95", "train.val_every_steps=10", "train.keep_checkpoints=2", "train.average_last=2")
    assert main(train_args(toy_data, tmp_path / "full", "train.max_steps=40", *opts)) == 0
    assert main(train_args(toy_data, tmp_path / "split", "train.max_steps=20", *opts)) == 0
    assert main(train_args(toy_data, tmp_path / "split", "train.max_steps=40", *opts)) == 0
    full, split = (load_file(tmp_path / name / "model.safetensors") for name in ("full", "split"))
    assert all(torch.equal(full[k], split[k]) for k in full)
    saved = torch.load(tmp_path / "full" / "checkpoints" / "step=40.ckpt", weights_only=True)
    assert saved[EMA_KEY]["updates"] == 40
    assert all(torch.equal(v, saved[EMA_KEY]["state_dict"][f"model.{k}"]) for k, v in full.items())
    assert not all(torch.equal(v, saved["state_dict"][f"model.{k}"]) for k, v in full.items())  # not the weights
    source = json.loads((tmp_path / "full" / "model.json").read_text())["source"]
    assert source.startswith("moving average of the weights (decay 0.95, 40 updates) in step=40.ckpt (validation loss ")
    run = tmp_path / "full"
    assert main(["average", "--model", str(run), "--last", "2"]) == 0
    assert json.loads((run / "model.json").read_text())["source"].startswith("average of 2 checkpoints")
    assert main(["average", "--model", str(run), "--ema"]) == 0
    assert load_file(run / "model.safetensors").keys() == full.keys()
    assert all(torch.equal(v, full[k]) for k, v in load_file(run / "model.safetensors").items())
    capsys.readouterr()
    for both_or_neither in (["--ema", "--last", "2"], []):
        assert main(["average", "--model", str(run), *both_or_neither]) == 1
        assert "give one of --last N" in capsys.readouterr().err
    plain = tmp_path / "plain"
    assert main(train_args(toy_data, plain, "train.max_steps=10", "train.val_every_steps=10")) == 0
    capsys.readouterr()
    assert main(["average", "--model", str(plain), "--ema"]) == 1
    assert "holds no moving average of the weights" in capsys.readouterr().err


def test_same_seed_same_metrics(toy_data, tmp_path):
    short = ("train.max_steps=40", "train.val_every_steps=20")
    for name in ("a", "b"):
        assert main(train_args(toy_data, tmp_path / name, *short)) == 0
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    assert len(metrics(tmp_path / "a")) == 2


def test_auto_precision_runs_the_faster_one_on_a_cpu(monkeypatch):
    cfg = load_config(TOY, ["train.precision=auto", "trainer.accelerator=cpu"])
    for speedup, chosen in ((2.0, "bf16-mixed"), (1.0, "32-true"), (0.55, "32-true")):
        monkeypatch.setattr("mt.train.run.bf16_speedup", lambda s=speedup: s)
        assert resolve_precision(cfg) == chosen

    def unmeasured():
        raise AssertionError("measured where nothing was to be chosen")

    monkeypatch.setattr("mt.train.run.bf16_speedup", unmeasured)
    assert resolve_precision(load_config(TOY, ["train.precision=bf16-mixed"])) == "bf16-mixed"
    # the ranks of a multi-process CPU run must agree, so none of them measures
    ddp = load_config(TOY, ["train.precision=auto", "trainer.accelerator=cpu", "trainer.devices=2"])
    assert resolve_precision(ddp) == "32-true"


def test_auto_precision_is_recorded_and_leaves_the_run_as_it_was(toy_data, tmp_path, monkeypatch, capsys):
    """The measurement runs (here forced to choose float32), the run then matches
    one that named 32-true, and config.yaml says what ran."""
    short = ("train.max_steps=40", "train.val_every_steps=20", "trainer.accelerator=cpu")
    monkeypatch.setattr("mt.train.run.BF16_MIN_SPEEDUP", math.inf)
    assert main(train_args(toy_data, tmp_path / "auto", *short, "train.precision=auto")) == 0
    assert "train.precision=auto: 32-true (bfloat16 products run at" in capsys.readouterr().out
    assert load_config(tmp_path / "auto" / "config.yaml").train.precision == "32-true"
    assert main(train_args(toy_data, tmp_path / "fp32", *short, "train.precision=32-true")) == 0
    assert metrics(tmp_path / "auto") == metrics(tmp_path / "fp32")


def test_each_epoch_trains_on_new_batches(toy_data, tmp_path, monkeypatch):
    """Lightning must reach the token sampler's set_epoch: a new shuffle every epoch."""
    epochs = []
    iterate = TokenBatchSampler.__iter__

    def recording(self):
        if self.shuffle:
            epochs.append([])
        for batch in iterate(self):
            if self.shuffle:
                epochs[-1].append(batch)
            yield batch

    monkeypatch.setattr(TokenBatchSampler, "__iter__", recording)
    assert main(train_args(toy_data, tmp_path / "run", "train.max_steps=-1", "train.max_epochs=2")) == 0
    assert len(epochs) == 2 and len(epochs[0]) == len(epochs[1]) > 1
    assert epochs[0] != epochs[1]
    assert sorted(sum(epochs[0], [])) == sorted(sum(epochs[1], []))  # the same pairs, once each


def test_resume_between_epochs_matches_uninterrupted(toy_data, tmp_path):
    full = ("train.max_steps=-1", "train.max_epochs=3")
    assert main(train_args(toy_data, tmp_path / "full", *full)) == 0
    assert main(train_args(toy_data, tmp_path / "split", "train.max_steps=-1", "train.max_epochs=1")) == 0
    assert main(train_args(toy_data, tmp_path / "split", *full)) == 0  # resumes from last.ckpt
    assert metrics(tmp_path / "split") == metrics(tmp_path / "full")
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "split" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_a_copied_run_keeps_only_the_last_checkpoints(toy_data, tmp_path):
    """Lightning forgets the files it saved when the run directory moves; the old ones must still go."""
    opts = ("train.val_every_steps=5", "train.keep_checkpoints=2", "train.average_last=2")
    assert main(train_args(toy_data, tmp_path / "a", "train.max_steps=20", *opts)) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(train_args(toy_data, tmp_path / "b", "train.max_steps=40", *opts)) == 0
    kept = sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step=*.ckpt"))
    assert kept == ["step=35.ckpt", "step=40.ckpt"]
    assert "step=35.ckpt, step=40.ckpt" in json.loads((tmp_path / "b" / "model.json").read_text())["source"]


def test_average_choose_exports_the_average_of_lowest_validation_loss(toy_data, tmp_path, capsys):
    """train.average_choose: of the averages of the newest 1..N checkpoints, the
    one whose validation loss is lowest becomes the inference model."""
    run = tmp_path / "r"
    opts = ("train.max_steps=80", "train.val_every_steps=10", "train.keep_checkpoints=5", "train.average_last=5")
    assert main(train_args(toy_data, run, *opts, "train.average_choose=true")) == 0
    cfg = load_config(run / "config.yaml")
    batches = list(TranslationDataModule(cfg.data).val_dataloader())
    paths = step_checkpoints(run / "checkpoints")
    losses = []
    for k in range(1, 6):
        model = speed_up(Transformer(cfg.model))  # as the run evaluated them
        model.load_state_dict({n.removeprefix("model."): v for n, v in average_checkpoints(paths[-k:]).items()})
        losses.append(validation_loss(model, batches))
    k = 1 + losses.index(min(losses))
    source = json.loads((run / "model.json").read_text())["source"]
    measured = " ".join(f"{x:.4f}" for x in losses)  # the averages' losses, newest 1 to 5, as measured here
    why = (source, measured, [p.name for p in paths])
    assert source.startswith(f"average of {k} checkpoint"), why
    assert measured in source, why
    exported = load_file(run / "model.safetensors")
    chosen = average_checkpoints(paths[-k:])
    assert all(torch.equal(v, chosen[f"model.{n}"]) for n, v in exported.items())
    # the command does the same on a run trained without it
    assert main(["average", "--model", str(run), "--last", "5"]) == 0
    assert json.loads((run / "model.json").read_text())["source"].startswith("average of 5 checkpoints: ")
    assert main(["average", "--model", str(run), "--last", "5", "--choose"]) == 0
    assert json.loads((run / "model.json").read_text())["source"] == source
    capsys.readouterr()
    assert main(["average", "--model", str(run), "--last", "0", "--choose"]) == 1
    assert "--choose picks how many" in capsys.readouterr().err


def test_average_command_rewrites_the_inference_model(toy_data, tmp_path, capsys):
    run = tmp_path / "r"
    opts = ("train.max_steps=20", "train.val_every_steps=5", "train.keep_checkpoints=3", "train.average_last=3")
    assert main(train_args(toy_data, run, *opts)) == 0
    assert main(["average", "--model", str(run), "--last", "1"]) == 0
    assert json.loads((run / "model.json").read_text())["source"] == "average of 1 checkpoint: step=20.ckpt"
    exported = load_file(run / "model.safetensors")
    last = torch.load(run / "checkpoints" / "step=20.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(v, last[f"model.{k}"]) for k, v in exported.items())
    capsys.readouterr()
    assert main(["average", "--model", str(run), "--last", "5"]) == 0  # more than the 3 kept
    assert "5 checkpoints asked for, 3 kept; averaging those" in capsys.readouterr().err
    assert json.loads((run / "model.json").read_text())["source"].startswith("average of 3 checkpoints: ")
    assert main(["average", "--model", str(run), "--last", "0"]) == 0
    assert json.loads((run / "model.json").read_text())["source"] == "best.ckpt"
    capsys.readouterr()
    assert main(["average", "--model", str(run), "--last", "-1"]) == 1
    assert "--last must be >= 0" in capsys.readouterr().err
    ckpt = run / "checkpoints" / "step=20.ckpt"
    data = ckpt.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside the weights: the same length, a failing CRC
    for broken, message in ((data[: len(data) // 2], "not a complete checkpoint"), (flipped, "damaged checkpoint")):
        ckpt.write_bytes(bytes(broken))
        assert main(["average", "--model", str(run), "--last", "1"]) == 1
        err = capsys.readouterr().err
        assert f"{ckpt}: {message}" in err and "Traceback" not in err
    (run / "checkpoints" / "last.ckpt").write_bytes(data[:1000])  # resuming from it fails before anything is written
    config_before = (run / "config.yaml").read_text()
    assert main(train_args(toy_data, run, *opts[1:], "train.max_steps=30")) == 1
    err = capsys.readouterr().err
    assert "last.ckpt: not a complete checkpoint" in err and "replace it with a step=N.ckpt" in err
    assert (run / "config.yaml").read_text() == config_before
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        ckpt.unlink()
    for last_n, message in (("2", "no step checkpoints (step=N.ckpt) to average"), ("0", "neither best.ckpt nor")):
        assert main(["average", "--model", str(run), "--last", last_n]) == 1
        err = capsys.readouterr().err
        assert f"{run / 'checkpoints'}: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("bpe_dropout", [0.0, 0.2])
def test_resume_after_sigkill_mid_epoch(toy_data, tmp_path, bpe_dropout, children):
    """Killed at an arbitrary moment; checkpoints every 7 steps fall mid-epoch.
    With BPE-dropout the resumed run must also redraw the same segmentations."""
    opts = (
        "train.max_steps=70",
        "train.val_every_steps=7",
        "train.keep_checkpoints=2",
        f"data.bpe_dropout={bpe_dropout}",
    )
    assert main(train_args(toy_data, tmp_path / "full", *opts)) == 0

    run = tmp_path / "killed"
    proc = children(mt_cmd(*train_args(toy_data, run, *opts)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: list((run / "checkpoints").glob("step=2*.ckpt")), proc, "a checkpoint at update 2x")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for ckpt in (run / "checkpoints").glob("*.ckpt"):  # every file is a complete checkpoint
        torch.load(ckpt, map_location="cpu", weights_only=True)
    assert main(train_args(toy_data, run, *opts)) == 0
    print("FULL", metrics(tmp_path / "full"))
    assert metrics(run)[-1] == metrics(tmp_path / "full")[-1]
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ctrl_c_exits_130_and_says_how_to_resume(toy_data, tmp_path, children):
    """SIGINT (Ctrl-C) mid-training: exit status 130 as for any interrupted
    command (Lightning's own handler exits 1), a line that says how to go on,
    complete checkpoints, and the same command resumes from them. The child gets
    SIGINT at its default however the test suite itself was started."""
    run = tmp_path / "interrupted"
    opts = ("train.max_steps=100000", "train.val_every_steps=7")
    proc = children(
        mt_cmd(*train_args(toy_data, run, *opts)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: (run / "checkpoints" / "last.ckpt").exists(), proc, "a first last.ckpt")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    assert f"rerun the same command to resume from {run / 'checkpoints' / 'last.ckpt'}" in err
    assert "mt train: interrupted" in err and "Traceback" not in err
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        torch.load(ckpt, map_location="cpu", weights_only=True)
    done = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert main(train_args(toy_data, run, "train.val_every_steps=7", f"train.max_steps={done + 7}")) == 0
    assert int(metrics(run)[-1]["step"]) + 1 == done + 7


def test_ddp_two_processes_on_cpu(toy_data, tmp_path):
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    args = train_args(
        toy_data, tmp_path / "ddp", "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu",
        "train.max_steps=-1", "train.max_epochs=1",
    )  # fmt: skip
    single = train_args(toy_data, tmp_path / "one", "train.max_steps=-1", "train.max_epochs=1")
    done = run_command(mt_cmd(*args), timeout=1200, env=env)
    assert done.returncode == 0, done.stderr
    assert main(single) == 0
    steps_ddp = int(metrics(tmp_path / "ddp")[-1]["step"])
    steps_one = int(metrics(tmp_path / "one")[-1]["step"])
    assert steps_ddp == steps_one // 2  # each rank trains on its half of the epoch's batches
    # the model it wrote is the checkpoint's, and it loads and translates
    model, tok, _ = load(tmp_path / "ddp")
    ckpt = torch.load(tmp_path / "ddp" / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=True)
    weights = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(Translator(model, tok, beam=1).translate(["the big dog sees a red bird"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.learning_rate=0.1", "unknown key train.learning_rate"),
        ("train.max_steps=many", "train.max_steps must be int"),
        ("model.activation=swish", "model.activation"),
        ("train.cooldown_steps=100000", "train.cooldown_steps: needs train.max_steps"),
        ("train.cooldown_minutes=5", "train.cooldown_minutes: needs train.max_minutes"),
        ("train.ema_decay=1", "train.ema_decay: must be in [0, 1)"),
        ("train.rdrop_alpha=-1", "train.rdrop_alpha: must be >= 0"),
        ("train.average_choose=true", "train.average_choose: needs train.average_last >= 1"),
    ],
)
def test_config_errors_are_one_line(toy_data, tmp_path, capsys, override, message):
    assert main(train_args(toy_data, tmp_path / "r", override)) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "toy.yaml with data.prepared_dir=" in err and override in err  # names the file and the overrides


def test_trainer_settings_that_cannot_run_are_one_line(toy_data, tmp_path, capsys):
    assert main(train_args(toy_data, tmp_path / "r", "trainer.strategy=nonsense")) == 1
    err = capsys.readouterr().err
    assert "trainer.strategy=nonsense" in err and "cannot run here" in err and "Traceback" not in err


def test_missing_prepared_data_and_unwritable_run_dir(toy_data, tmp_path, capsys):
    assert main(train_args(tmp_path / "nothing", tmp_path / "r")) == 1
    assert "run `mt prepare" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(train_args(toy_data, blocker / "run")) == 1
    assert "not writable" in capsys.readouterr().err
