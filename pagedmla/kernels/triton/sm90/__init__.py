"""pagedmla's Hopper (sm_90a) kernels in Gluon: warp-specialised, TMA-fed, warpgroup MMAs.

``pipeline.py`` holds what every one shares (descriptors, ring phases, the persistent tile claim and
hand-off), ``mla.py`` the absorbed-MLA steps of the decode and paged-prefill kernels; ``decode.py``,
``seesaw.py`` (the decode kernel for 128-row requests), ``paged_varlen.py`` and ``varlen.py`` each hold one
kernel's partitions and launcher. The portable launchers
(``kernels/triton/{decode,paged_varlen,varlen}.py``) pick these where the support checks accept a call.
"""
