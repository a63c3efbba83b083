"""Imported last by the test suite's forkserver (`tests._dist`): everything preloaded before it moves to the garbage
collector's permanent generation (`gc.freeze()`), so that the forked ranks' collections do not traverse the preloaded
modules' objects again and again (nor touch, and so copy, their pages)."""

import gc

gc.freeze()
