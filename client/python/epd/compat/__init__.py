"""Fronts with the names of other expert-parallel libraries, over :mod:`epd`.

:mod:`epd.compat.deep_ep` offers DeepEP's normal-mode ``Buffer`` (``get_dispatch_layout``,
``dispatch``, ``combine``).
"""
