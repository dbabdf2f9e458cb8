"""The main job, ``python -m jaxcomp.train``: a Flax model trained once per compressor, compared.

The application layer of jaxcomp: it may import Flax, scikit-learn, tqdm and matplotlib, which
``import jaxcomp`` never loads. Modules: ``job`` (the command line and the training loop), ``tasks``
(data that ships with Python or scikit-learn, and the models) and ``registry`` (the named compressors
that the main job, the benchmarks and the tests share).
"""
