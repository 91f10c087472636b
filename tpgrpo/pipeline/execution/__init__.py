"""How stages start and run: the stage runner that every ``tpgrpo stage`` command goes through (``stage_runner``),
the stage server that forks them (``stage_server``, its children ``stage_children``, its client
``stage_client``), the watch on the code a long-lived process imported (``processes``) and the launchers of
multi-process stages (``launch``)."""
