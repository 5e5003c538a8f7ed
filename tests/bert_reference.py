"""google-research/bert (PyPI ``bert-tensorflow``) importable without TensorFlow.

The reference's pure-Python parts (tokenization, create_pretraining_data,
run_squad's feature conversion and post-processing) only touch TensorFlow for
flags, logging and file access. A stand-in ``tensorflow`` module gives them
exactly that, so tests can run the reference in-process as an oracle:

    from bert_reference import reference
    tokenization = reference("tokenization")
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
import sys
import types


class _Flags:
    """``tf.flags``: DEFINE_* record defaults on FLAGS; tests set attributes directly."""

    class _Values(types.SimpleNamespace):
        def __call__(self, argv):  # absl parses argv here; nothing to do
            return argv

    def __init__(self):
        self.FLAGS = self._Values()

    def _define(self, name, default, *args, **kwargs):
        setattr(self.FLAGS, name, default)

    DEFINE_string = DEFINE_bool = DEFINE_boolean = DEFINE_integer = DEFINE_float = DEFINE_list = _define

    def mark_flag_as_required(self, name):
        pass


def _gfile_open(path, mode="r"):
    return open(path, mode) if "b" in mode else open(path, mode, encoding="utf-8")


def _standin() -> types.ModuleType:
    tf = types.ModuleType("tensorflow")
    tf.__path__ = []  # a package, so "from tensorflow.contrib import layers" resolves
    v1 = types.ModuleType("tensorflow.compat.v1")
    v1.flags = _Flags()
    v1.logging = logging.getLogger("bert_reference")
    v1.logging.set_verbosity = lambda level: None
    v1.logging.INFO = logging.INFO
    v1.gfile = types.SimpleNamespace(GFile=_gfile_open, Open=_gfile_open, Glob=glob.glob,
                                     Exists=os.path.exists, MakeDirs=lambda p: os.makedirs(p, exist_ok=True))
    v1.app = types.SimpleNamespace(run=lambda main=None: None)
    v1.train = types.SimpleNamespace(Optimizer=object)  # optimization.py subclasses it at import
    tf.compat = types.ModuleType("tensorflow.compat")
    tf.compat.v1 = v1
    tf.contrib = types.ModuleType("tensorflow.contrib")  # modeling.py imports contrib.layers
    tf.contrib.layers = types.ModuleType("tensorflow.contrib.layers")
    for name, value in vars(v1).items():
        if not name.startswith("__"):
            setattr(tf, name, value)
    return tf


def reference(name: str) -> types.ModuleType:
    """Import ``bert.<name>`` with the stand-in in place of TensorFlow.

    The stand-in is in ``sys.modules`` only while the reference imports: other
    code (tensorboard) looks for a real TensorFlow there and must not find ours.
    """
    tf = _standin()
    names = {"tensorflow": tf, "tensorflow.compat": tf.compat, "tensorflow.compat.v1": tf.compat.v1,
             "tensorflow.contrib": tf.contrib, "tensorflow.contrib.layers": tf.contrib.layers}
    saved = {key: sys.modules.get(key) for key in names}
    sys.modules.update(names)
    try:
        module = importlib.import_module(f"bert.{name}")
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    from absl import flags  # tokenization.py reads one real absl flag, at its default

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return module
