"""The main job, ``python -m jaxcomp.train``: a Flax model trained once per compressor, compared.

The application layer of jaxcomp: it may import Flax, scikit-learn, tqdm and matplotlib, which
``import jaxcomp`` never loads. This file imports nothing: ``device_setup`` (the simulated CPU
devices, asked of JAX before it starts) loads none of them, so the tests and the benchmarks set up
their devices without loading the job.

Modules: ``cli`` (the command line and ``main``), ``device_setup``, ``training_loop`` (``train``:
every compressor side by side), ``runs`` (what a run produced, the table, the modelled time to
target), ``plots`` (``OUT/loss.png``), ``training_step`` (its ``jaxcomp.data_parallel`` step,
shared with the slow-link workers and the benchmarks), ``tasks`` (data that ships with Python or
scikit-learn, and the models), ``registry`` (the named compressors that the main job, the
benchmarks and the tests share), ``network`` (the α-β model of time on a link), ``units``; a real
rate-limited link: ``namespaces`` (a network namespace, its ``tc`` rate limit and its cleanup) and
``link_job`` (training processes timed over it); and the planner of ``--plan``: ``planner`` (the
projection), ``recommend`` (its answer), ``plan_text`` (its text and plot), ``compute`` (each
entry's update compiled at the model's shapes), ``hlo_cost`` (a compiled program's kernels: FLOPs
and bytes), ``devices`` (the accelerators' rooflines, dated), ``evidence`` (steps to target by model
size, and the papers'), ``user_model`` (``--model module:function``), ``wire`` (each entry's bytes
per step at any layer shapes, from the algorithm's definition), ``shapes`` (published models'
parameter shapes, shared with the benchmarks), ``fsdp_plan`` (memory and bytes of the sharded ways
to train) and ``measured`` (the dated steps to target, ``measured.json``).
"""
