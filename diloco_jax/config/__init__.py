"""The config: its fields, one validation, and what it stands for.

  schema.py        every field with its default and meaning (base_config).
  schema_diloco.py the config.diloco section of it.
  validation.py    validate_config: every check at once, one ConfigError
                   listing every problem; returns a RunConfig.
  diloco_checks.py the checks of config.diloco.
  pipeline_checks.py the checks of pipelined islands (mesh.stage, pipeline).
  overlap_defaults.py the outer optimizer's defaults per overlap mode,
                   filled in where a config leaves them unset (what it
                   sets is kept, file or flag alike), and the run's
                   'outer step:' log line, naming the overlap's measured
                   step and its flags where the run takes another.
  problems.py      collecting problems; ConfigError.
  run_config.py    RunConfig: the frozen config with what it stands for
                   parsed once (islands, codec, schedule, participation,
                   data settings), and the builders of those.
  changes.py       which changes of a config a resume allows.
  flag_errors.py   one line for a --config flag that does not parse.

May import codecs/, parallel/, algorithm/, model/ and data/. Nothing below
reads the config: the run layer hands typed values down.
"""
