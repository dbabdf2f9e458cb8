"""The main job, ``python -m jaxcomp.train``: a Flax model trained once per compressor, compared.

The application layer of jaxcomp: it may import Flax, scikit-learn, tqdm and matplotlib, which
``import jaxcomp`` never loads. Modules: ``job`` (the command line and the training loop),
``training_step`` (its ``jaxcomp.data_parallel`` step, shared with the slow-link workers and the
benchmarks), ``tasks`` (data that ships with Python or scikit-learn, and the models), ``registry``
(the named compressors that the main job, the benchmarks and the tests share), ``network`` (the α-β
model of time on a link), ``link`` (a real rate-limited link in a network namespace), and the
planner of ``--plan``: ``planner`` (the projection), ``wire`` (each entry's bytes per step at any
layer shapes, from the algorithm's definition), ``shapes`` (published models' parameter shapes) and
``measured`` (the dated measurements it projects from, ``measured.json``).
"""
