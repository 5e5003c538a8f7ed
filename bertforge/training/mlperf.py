"""MLPerf BERT: the evaluation cadence and the MLPerf log of a pre-training run.

    pip install "bertforge[mlperf]"
    bertforge pretrain --config mlperf_bert --init ckpt/model.ckpt-28252 --data.input records/ \\
        --data.eval_input eval/eval_10k.tfrecord --log.mlperf result_0.txt
    python -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 result_0.txt

``log.mlperf PATH`` writes, with the ``mlperf-logging`` package's ``mllog``,
the keys and events that the compliance checker's closed-division BERT rules
of training ruleset 5.0.0 ask for (``compliance_checker/training_5.0.0/
common.yaml``, ``closed_common.yaml``, ``closed_bert.yaml``): submission
info, ``cache_clear``, ``init_start/stop``, ``run_start/stop`` with the
status, the global batch and gradient accumulation, the LAMB and schedule
hyperparameters, ``block_start/stop`` around the training between two
evaluations, ``eval_start/stop`` and ``eval_accuracy`` with ``epoch_num`` in
samples, ``eval_samples`` and ``train_samples``. Only rank 0 writes; the
package is imported only when a log is asked for.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertforge.config import ConfigError, DataConfig, LogConfig, TrainConfig
from bertforge.host import device_name

if TYPE_CHECKING:
    from bertforge.parallel.dist import DistContext

BENCHMARK = "bert"
DIVISION = "closed"
SUBMISSION_STATUS = "onprem"


def eval_interval_samples(global_batch_size: int) -> int:
    """Samples between evaluations for a global batch, as the MLPerf BERT rules fix it:

        floor(0.05 × (230.23 × global_batch + 3,000,000) / 25,000) × 25,000

    computed in integers (230.23 = 23023 / 100), so no rounding of a float
    decides a boundary: 150,000 for batches up to 2,171, 175,000 from 2,172, 225,000 for 8,192.
    """
    if global_batch_size < 1:
        raise ConfigError(f"train.global_batch_size={global_batch_size} must be at least 1")
    return (23023 * global_batch_size + 300_000_000) // 50_000_000 * 25_000


def eval_every_samples(train: TrainConfig) -> int:
    """``train.eval_every_samples`` as a number of samples (``mlperf``: the formula above); 0 = off."""
    value = train.eval_every_samples
    return eval_interval_samples(train.global_batch_size) if value == "mlperf" else value


def eval_due(train: TrainConfig, step: int) -> bool:
    """Whether the run evaluates after optimizer step ``step`` (≥ 1): when the samples trained
    reach the next multiple of the interval in samples, else every ``train.eval_every`` steps."""
    interval = eval_every_samples(train)
    if interval > 0:
        batch = train.global_batch_size
        return step * batch // interval > (step - 1) * batch // interval
    return train.eval_every > 0 and step % train.eval_every == 0


def drop_page_cache(files: list[Path]) -> bool:
    """Evict the files' pages from the OS page cache (``posix_fadvise`` DONTNEED: no root
    needed), so the run reads its data from storage as the rules ask; whether it could."""
    if not hasattr(os, "posix_fadvise") or not files:
        return False
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return False
        finally:
            os.close(fd)
    return True


class NoLog:
    """What a run without ``log.mlperf`` (or a rank other than 0) logs: nothing."""

    def run_start(self, train: TrainConfig, data: DataConfig, accumulation: int, steps: int,
                  eval_sequences: int) -> None:
        pass

    def train(self, samples: int) -> None:
        pass

    def eval_start(self, samples: int) -> None:
        pass

    def eval_stop(self, samples: int, mlm_accuracy: float) -> None:
        pass

    def run_stop(self, samples: int, status: str) -> None:
        pass


class _AppendHandler(logging.Handler):
    """Appends each record to a file, opened only for that write: the log is complete on disk
    after every event, and there is no file handle to close when a run fails."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(self.format(record) + "\n")


class MLPerfLog(NoLog):
    """One run's MLPerf log at ``log.mlperf`` (started anew by a fresh run, appended to on resume).

    Opening logs ``cache_clear``, ``init_start`` and the submission info; the
    training loop calls :meth:`run_start`, :meth:`train` before each step,
    :meth:`eval_start` / :meth:`eval_stop` around each evaluation and
    :meth:`run_stop` at the end. ``samples`` is always the number of training
    sequences consumed so far, the unit of ``epoch_num`` in MLPerf BERT logs.
    """

    def __init__(self, log: LogConfig, platform_name: str, files: list[Path], append: bool = False):
        from mlperf_logging import mllog  # the [mlperf] extra: open_log checked it

        self.constants = mllog.constants
        self.path = Path(log.mlperf)
        try:
            with open(self.path, "a" if append else "w", encoding="utf-8"):
                pass
        except OSError as err:
            raise ConfigError(f"log.mlperf: cannot write {log.mlperf}: {err.strerror or err}") from None
        # A logger of its own, in no registry: two runs in one process never mix, nothing reaches the console.
        logger = logging.Logger(f"bertforge.training.mlperf:{self.path}", logging.INFO)
        logger.addHandler(_AppendHandler(self.path))
        self.mllogger = mllog.mllog.MLLogger(logger, default_stack_offset=2)
        self.in_block = False
        c = self.constants
        self.event(c.CACHE_CLEAR, drop_page_cache(files))
        self.mllogger.start(c.INIT_START)
        self.event(c.SUBMISSION_BENCHMARK, BENCHMARK)
        self.event(c.SUBMISSION_DIVISION, DIVISION)
        self.event(c.SUBMISSION_ORG, log.mlperf_org or "bertforge")
        self.event(c.SUBMISSION_PLATFORM, log.mlperf_platform or platform_name)
        self.event(c.SUBMISSION_STATUS, SUBMISSION_STATUS)

    def event(self, key: str, value: Any = None, metadata: dict[str, Any] | None = None) -> None:
        # The call site logged is the caller of the method that called this one (training/pretrain.py's line).
        self.mllogger.event(key, value, metadata=metadata, stack_offset=3)

    def run_start(self, train: TrainConfig, data: DataConfig, accumulation: int, steps: int,
                  eval_sequences: int) -> None:
        """The hyperparameters the rules check, then ``init_stop`` and ``run_start``."""
        from .optim import warmup_steps

        c, t = self.constants, train
        warmup = warmup_steps(t, steps)
        for key, value in (
                (c.SEED, t.seed),
                (c.GLOBAL_BATCH_SIZE, t.global_batch_size),
                (c.GRADIENT_ACCUMULATION_STEPS, accumulation),
                (c.MAX_SEQUENCE_LENGTH, data.seq_len),
                ("max_predictions_per_seq", data.max_predictions),
                (c.OPT_NAME, c.LAMB),
                (c.OPT_BASE_LR, t.lr),
                (c.OPT_LAMB_EPSILON, t.eps),
                (c.OPT_LAMB_BETA_1, t.beta1),
                (c.OPT_LAMB_BETA_2, t.beta2),
                (c.OPT_LAMB_WEIGHT_DECAY, t.weight_decay),
                (c.OPT_LAMB_LR_DECAY_POLY_POWER, t.decay_power),
                (c.OPT_LR_TRAINING_STEPS, steps),
                (c.OPT_LR_WARMUP_STEPS, warmup),
                (c.NUM_WARMUP_STEPS, warmup),
                (c.START_WARMUP_STEP, t.start_warmup_step),
                (c.EVAL_SAMPLES, eval_sequences)):
            self.event(key, value)
        self.mllogger.end(c.INIT_STOP)
        self.mllogger.start(c.RUN_START)

    def train(self, samples: int) -> None:
        """Before a step: a block of training starts unless one is open."""
        if not self.in_block:
            self.mllogger.start(self.constants.BLOCK_START, metadata={"samples_count": samples})
            self.in_block = True

    def _end_block(self, samples: int) -> None:
        if self.in_block:
            self.mllogger.end(self.constants.BLOCK_STOP, metadata={"samples_count": samples})
            self.in_block = False

    def eval_start(self, samples: int) -> None:
        self._end_block(samples)
        self.mllogger.start(self.constants.EVAL_START, metadata={"epoch_num": samples})

    def eval_stop(self, samples: int, mlm_accuracy: float) -> None:
        c = self.constants
        self.mllogger.end(c.EVAL_STOP, metadata={"epoch_num": samples})
        self.event(c.EVAL_ACCURACY, mlm_accuracy, metadata={"epoch_num": samples})

    def run_stop(self, samples: int, status: str) -> None:
        """``status``: ``success`` (the target was reached) or ``aborted``."""
        c = self.constants
        self._end_block(samples)
        self.event(c.TRAIN_SAMPLES, samples)
        self.mllogger.end(c.RUN_STOP, metadata={"status": status})


def open_log(log: LogConfig, train: TrainConfig, data: DataConfig, dist: DistContext,
             resumed: bool = False) -> NoLog:
    """The run's MLPerf log: an :class:`MLPerfLog` on rank 0 when ``log.mlperf`` names a file,
    else a :class:`NoLog`. Every rank refuses a run that cannot be logged (before any work)."""
    if not log.mlperf:
        return NoLog()
    try:
        import mlperf_logging.mllog  # noqa: F401
    except ImportError:
        raise ConfigError("log.mlperf needs the mlperf-logging package: "
                          "pip install 'bertforge[mlperf]'") from None
    if train.optimizer != "lamb":
        raise ConfigError(f"log.mlperf: the MLPerf BERT rules train with LAMB, not "
                          f"train.optimizer={train.optimizer}")
    if data.synthetic:
        raise ConfigError("log.mlperf needs real data and an eval set, not data.synthetic")
    files = data_files(data)
    if files and not data.eval_input:
        raise ConfigError("log.mlperf needs an eval set: give data.eval_input (the 10,000 eval records)")
    if not dist.is_main:
        return NoLog()
    return MLPerfLog(log, f"{dist.world_size}x{device_name(dist.device)}", files, append=resumed)


def data_files(data: DataConfig) -> list[Path]:
    """The record files a run reads (training shards, then the eval file); none for text input."""
    from bertforge.data.loader import is_records, record_files

    if not (data.input and is_records(data.input)):
        return []
    return record_files(data.input) + ([Path(data.eval_input)] if data.eval_input else [])
