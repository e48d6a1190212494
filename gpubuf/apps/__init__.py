"""The apps around the buffers: model-based RL (:mod:`gpubuf.apps.mbrl`), what ``gpubuf demo`` runs
(:mod:`gpubuf.apps.demo`), the command line (:mod:`gpubuf.apps.cli`) and ``gpubuf bench``
(:mod:`gpubuf.apps.benchmarking`). Each loads when used."""
