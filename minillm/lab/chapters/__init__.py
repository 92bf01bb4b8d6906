"""The plumbing of each lab, out of the reader's way (one module per lab, named after it).

A lab's cells show its experiments: the engine calls, one table or figure each. What turns their
results into figures and into the numbers and sentences its chapter glues lives here, in
``chNN_<name>.py`` beside the lab ``notebooks/chNN-<name>.ipynb``, and is tested like the rest of
the kit (``tests/test_lab_chNN_<name>.py``).
"""
