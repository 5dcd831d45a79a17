"""Several processes on one video: the layout (:mod:`.plan`), classifier-free-guidance parallel
(:mod:`.cfg`) and Ulysses sequence parallel (:mod:`.sequence`).

Like :mod:`pfctl.models.fast`, these are layers put on a built model: the DiT classes stay the plain
reference computation. ``pfctl generate`` applies them (:mod:`pfctl.sampling.parallel`).
"""
