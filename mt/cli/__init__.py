"""The ``mt`` command: one entry point (``main``), one subcommand per job.

Each subcommand's code is in the package of the same job:

    mt prepare            mt.data
    mt train, average     mt.train
    mt translate          mt.decode
    mt evaluate           mt.evaluate
    mt attention          mt.inspect
    mt serve              mt.serve
    mt export             mt.export

May import every package; none imports it.
"""
