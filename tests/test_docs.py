"""The docs stay true to the code: every command they show names modules,
files and config fields that exist, and every link, anchor and module path
resolves.

The commands themselves are not run here (most train for minutes). Each
`python -m diloco_jax.main` command (directly, under the launcher, srun or
gcloud's --command) is parsed with main's flags and its config checked as
main checks it before creating anything: the URL check of its workdir and
`validate_config`, with as many devices as main creates on a CPU host
(islands x mesh.data x mesh.stage). What needs the command's machines is
left out: the processes of a multi-host run (tests/test_multihost.py) and
the reader's own files. A data path or tokenizer path under /data/, ~/ or
$HOME/, or with an upper-case placeholder in it (MODEL), names the
reader's files:
it is replaced by a file of the same kind made here (C4 JSON-lines shards,
a SentencePiece model, shards prepared with the command's tokenizer), so
every check runs but the path's existence. Any
other path must exist. Other `python -m` commands of ours (experiments,
the C4 tools) are checked against their modules' flags. Commands quoted
in prose are checked the same way.
"""

import ast
import gzip
import importlib
import importlib.util
import json
import pathlib
import re
import shlex

from absl import flags
from ml_collections import config_flags
import pytest
import sentencepiece

from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema
from diloco_jax.config import validation
from diloco_jax.data import prepare
from diloco_jax.data import prepare_plan
from diloco_jax.elastic import settings as elastic_settings
from diloco_jax.storage import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BUILD.md",
                *(ROOT / "docs").glob("*.md")])
LAYERS = ("codecs", "parallel", "algorithm", "config", "model", "data",
          "analysis", "run")


def _ids(paths):
  return [str(p.relative_to(ROOT)) for p in paths]


def _shell_lines(page: pathlib.Path) -> list[str]:
  """The lines of the page's bash/sh code blocks, continuations joined."""
  blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(),
                      re.S)
  return [line for block in blocks
          for line in block.replace("\\\n", " ").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]


def _placeholder(name: str) -> bool:
  """CONFIG, FIELD, STUDY: a name the reader fills in."""
  return any(part.isupper() for part in re.split(r"[./]", name))


def _config_fields() -> set[str]:
  def walk(node, prefix=""):
    for key in node.keys():
      value = node[key]
      if hasattr(value, "keys"):
        yield from walk(value, f"{prefix}{key}.")
      else:
        yield prefix + key
  return set(walk(config_schema.base_config()))


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_commands_name_what_exists(page):
  fields = _config_fields()
  problems = []
  for line in _shell_lines(page):
    for module in re.findall(r"python3? -m ([\w.]+)", line):
      if (module.split(".")[0] in ("diloco_jax", "experiments", "benchmarks")
          and not _placeholder(module)):
        if importlib.util.find_spec(module) is None:
          problems.append(f"no module {module}: {line}")
    for script in re.findall(r"python3? ((?:experiments|benchmarks)/\w+\.py)",
                             line):
      if not (ROOT / script).exists():
        problems.append(f"no script {script}: {line}")
    for config in re.findall(r"--config=([\w/.]+\.py)", line):
      if not _placeholder(config) and not (ROOT / config).exists():
        problems.append(f"no config {config}: {line}")
    for field in re.findall(r"--config\.([\w.]+)=", line):
      if not _placeholder(field) and field not in fields:
        problems.append(f"no config field {field}: {line}")
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_links_and_module_paths_resolve(page):
  # docs/architecture.md ends with the modules' names before the layers.
  text = page.read_text().split("## Moved modules")[0]
  problems = []
  for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
    if not re.match(r"\w+://", target) and not (
        page.parent / target).exists():
      problems.append(f"link to {target}")
  # Module paths: diloco_jax/x.py, or LAYER/x.py under diloco_jax/.
  for path in re.findall(r"(?<![\w/])(?:diloco_jax/)?((?:" + "|".join(LAYERS)
                         + r")/\w+\.py)", text):
    if not (ROOT / "diloco_jax" / path).exists():
      problems.append(f"module path {path}")
  for path in re.findall(r"(?<![\w/])diloco_jax/(\w+\.py)", text):
    if not (ROOT / "diloco_jax" / path).exists():
      problems.append(f"module path diloco_jax/{path}")
  assert not problems, "\n".join(problems)


# Commands, parsed and validated.

_OURS = re.compile(r"(?:diloco_jax|experiments|benchmarks)\.[\w.]+")


def _commands(line: str) -> list[tuple[str, list[str]]]:
  """(module, its arguments) of every `python -m MODULE` of ours in a
  shell line: commands joined by && or ;, and a command quoted inside
  another's argument (gcloud's --command="..."), included."""
  lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
  lexer.whitespace_split = True
  try:
    words = list(lexer)
  except ValueError:  # an unbalanced quote: not a command
    return []
  found, command = [], []
  for word in [*words, ";"]:
    if word in ("&&", ";", "||", "|"):
      for i, arg in enumerate(command[:-1]):
        if arg == "-m" and _OURS.fullmatch(command[i + 1]):
          found.append((command[i + 1], command[i + 2:]))
          break
      command = []
    elif "python" in word and " -m " in word:  # a nested command
      found += _commands(word.split("=", 1)[1] if word.startswith("-")
                         else word)
    else:
      command.append(word)
  return found


def _page_commands(page: pathlib.Path
                   ) -> list[tuple[str, list[str], bool]]:
  """(module, arguments, whether quoted in prose) of the commands of the
  page's shell blocks, then of those quoted in its prose (`python -m
  ...`). In the blocks, a variable the page assigns (FLAGS="...") is
  expanded where a later line uses it ($FLAGS). A command in prose may
  leave its workdir and data files to its sentence ("on the shards
  above"); a bare `python -m diloco_jax.main` (or .elastic) is a name,
  not a command."""
  commands, variables = [], {}
  for line in _shell_lines(page):
    assignment = re.fullmatch(r"([A-Za-z_]\w*)=(.*)", line.strip())
    if assignment:
      variables[assignment[1]] = " ".join(shlex.split(assignment[2]))
      continue
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m[1], m[0]),
                  line)
    commands += [(module, args, False) for module, args in _commands(line)]
  prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  for code in re.findall(r"`([^`]+)`", prose):
    for module, args in _commands(" ".join(code.split())):
      if module in ("diloco_jax.main", "diloco_jax.elastic"):
        if not any(arg.startswith("--config=") for arg in args):
          continue
        if not any(arg.startswith("--workdir=") for arg in args):
          args = [*args, "--workdir=DIR"]
      commands.append((module, args, True))
  return commands


def _defined_flags(module: str) -> dict[str, str]:
  """{flag: kind} of the absl flags a module of ours defines, read from its
  source: importing main or launch here would define their flags in this
  process's global FLAGS, where other modules define some of the same
  names."""
  path = ROOT / (module.replace(".", "/") + ".py")
  if not path.exists():  # a package run with -m: its __main__
    path = ROOT / module.replace(".", "/") / "__main__.py"
  # A module whose command line lives beside it (prepare.py's in
  # prepare_command.py) defines its flags there.
  command = path.with_name(f"{path.stem}_command.py")
  source = path.read_text() + (command.read_text() if command.exists()
                               else "")
  kinds = {}
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("DEFINE_") and node.args
        and isinstance(node.args[0], ast.Constant)):
      kinds[node.args[0].value] = node.func.attr[len("DEFINE_"):]
  return kinds


def _without_placeholders(args: list[str], kinds: dict[str, str]
                          ) -> list[str]:
  """`args` less a number flag given a placeholder (--num_processes=N):
  the reader fills it in. Its name is still checked."""
  kept = []
  for arg in args:
    name, _, value = arg.lstrip("-").partition("=")
    if (kinds.get(name) in ("integer", "float")
        and re.fullmatch(r"[A-Z]\w*", value)):
      continue
    kept.append(arg)
  return kept


def _parse(module: str, args: list[str]) -> flags.FlagValues:
  """The module's flags parsed from `args`, in a FlagValues of their own;
  raises absl's errors (an unknown flag, a bad value, a config file that
  does not load, an unknown --config.x field)."""
  kinds = _defined_flags(module)
  argv = [module, *_without_placeholders(args, kinds)]
  values = flags.FlagValues()
  for name, kind in kinds.items():
    if kind == "config_file":
      # sys_argv: the overrides it defines flags for (default: sys.argv).
      config_flags.DEFINE_config_file(name, None, "", flag_values=values,
                                      lock_config=True, sys_argv=argv)
    else:
      getattr(flags, f"DEFINE_{kind}")(name, None, "", flag_values=values)
  values(argv)
  return values


def _is_placeholder_path(path: str) -> bool:
  """A path the docs use for the reader's own files."""
  return (path.startswith(("/data/", "~/", "$HOME/"))
          or any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part)
                 for part in re.split(r"[/.]", path)))


@pytest.fixture(scope="module")
def reader_files(tmp_path_factory):
  """Files standing in for the reader's: C4 shards and a SentencePiece
  model trained on them (built when a command needs it)."""
  root = tmp_path_factory.mktemp("reader_files")
  texts = [f"document {i} about topic {i % 7}: " + "words " * (i % 13 + 3)
           for i in range(300)]
  shards = root / "c4"
  shards.mkdir()
  for name, part in (("c4-train.00000-of-00002.json.gz", texts[:150]),
                     ("c4-train.00001-of-00002.json.gz", texts[150:250]),
                     ("c4-validation.00000-of-00001.json.gz", texts[250:])):
    with gzip.open(shards / name, "wt") as f:
      f.writelines(json.dumps({"text": t}) + "\n" for t in part)
  (root / "corpus.txt").write_text("\n".join(texts))

  def tokenizer() -> str:
    model = root / "spm.model"
    if not model.exists():
      sentencepiece.SentencePieceTrainer.train(
          input=str(root / "corpus.txt"), model_prefix=str(root / "spm"),
          vocab_size=64, hard_vocab_limit=False, minloglevel=2)
    return str(model)

  def tokens(kind: str) -> str:
    """The shards above prepared with the stand-in tokenizer of `kind`
    (a run on them must name the tokenizer that made them)."""
    output = root / f"tokens_{kind}"
    if not output.exists():
      model = tokenizer() if kind == "sentencepiece" else ""
      prepare.prepare(prepare_plan.make_plan("c4", str(shards), str(output),
                                             model), processes=1)
    return str(output)

  return {"c4": str(shards), "text_files": str(root / "corpus.txt"),
          "tokenizer": tokenizer, "tokens": tokens}


def _with_reader_files(config, reader_files, fill: bool = False
                       ) -> list[str]:
  """Points config.data's placeholder paths (with `fill`, its empty ones
  too) at reader_files; returns the problems of paths that are neither
  placeholders nor there."""
  problems, data = [], config.data
  fields = [("path", lambda: reader_files["tokens"](data.tokenizer)
             if data.corpus == "tokens" else reader_files.get(data.corpus))]
  if data.tokenizer == "sentencepiece":
    fields.append(("tokenizer_path", reader_files["tokenizer"]))
  for field, stand_in in fields:
    path = data[field]
    if not path and fill and stand_in() is not None:
      data[field] = stand_in()
      continue
    if not path or pathlib.Path(path).exists() or data.get("tfds_name"):
      continue
    if not _is_placeholder_path(path) or stand_in() is None:
      problems.append(f"config.data.{field}={path!r} does not exist")
      continue
    data[field] = stand_in()
  return problems


def _main_problems(args: list[str], reader_files, prose: bool = False
                   ) -> list[str]:
  """What main would refuse of its arguments `args` before creating
  anything, one line each (`prose`: a command quoted in a sentence, whose
  data files the sentence names)."""
  config_values = [a.split("=", 1)[1] for a in args
                   if a.startswith("--config=")]
  if (any(_placeholder(value) for value in config_values)
      or any(re.fullmatch(r"[A-Z]+", arg) for arg in args)):
    return []  # a template (--config=configs/CONFIG.py, -- FLAGS)
  try:
    parsed = _parse("diloco_jax.main", args)
  except Exception as e:  # pylint: disable=broad-except
    return [f"flags: {str(e).strip().splitlines()[-1]}"]
  problems = []
  for name in ("config", "workdir"):
    if parsed[name].value is None:
      problems.append(f"--{name} is required")
  if problems:
    return problems
  try:
    workdir_lib.refuse_url(parsed["workdir"].value)
  except workdir_lib.WorkdirError as e:
    problems.append(str(e))
  config = parsed["config"].value
  problems += _with_reader_files(config, reader_files, fill=prose)
  devices = (run_config.effective_islands(config)
             * run_config.devices_per_island(config))
  try:
    validation.validate_config(config, num_devices=devices)
  except validation.ConfigError as e:
    problems.append(str(e))
  return problems


def _experiment_problems(module: str, args: list[str]) -> list[str]:
  """Flags of `python -m experiments.X` that no experiments module
  defines (X's own and study_lib's among them) or whose value it would not
  parse; studies experiments.all does not know or would skip."""
  if _placeholder(module):
    return []  # experiments.STUDY: the reader picks one
  imported = importlib.import_module(module)
  defined = {flag.name: flag for name, module_flags
             in flags.FLAGS.flags_by_module_dict().items()
             if name.split(".")[0] == "experiments" for flag in module_flags}
  problems = []
  for arg in args:
    name, _, value = arg.lstrip("-").partition("=")
    if name not in defined:
      problems.append(f"--{name}: {module} has no such flag")
      continue
    try:
      defined[name].parser.parse(value)
    except ValueError as e:
      problems.append(f"--{name}={value}: {e}")
  if module == "experiments.all":
    values = dict(arg.lstrip("-").partition("=")[::2] for arg in args)
    names = values.get("studies", "").split(",") if "studies" in values else []
    scale = values.get("scale", "small")
    try:
      chosen = imported.chosen(names or None, scale)
      if names and len(chosen) != len(names):
        problems.append(f"--studies={values['studies']}: some do not run at "
                        f"--scale={scale}")
    except SystemExit as e:
      problems.append(str(e))
  return problems


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_command_parses_and_its_config_validates(page, reader_files):
  problems = []
  for module, args, prose in _page_commands(page):
    if module == "diloco_jax.launch":
      launcher, _, main_args = " ".join(args).partition(" -- ")
      try:
        _parse(module, launcher.split())
      except Exception as e:  # pylint: disable=broad-except
        problems.append(f"{module}: {str(e).strip().splitlines()[-1]}")
      found = _main_problems(main_args.split(), reader_files)
    elif module == "diloco_jax.main":
      found = _main_problems(args, reader_files, prose)
    elif module.startswith("experiments."):
      found = _experiment_problems(module, args)
    elif module == "diloco_jax.elastic":
      found = _elastic_problems(args)
    else:  # another tool of ours (diloco_jax.data.c4_download, ...)
      try:
        _parse(module, args)
        found = []
      except Exception as e:  # pylint: disable=broad-except
        found = [f"flags: {str(e).strip().splitlines()[-1]}"]
    problems += [f"{module} {' '.join(args)}\n  {p}" for p in found]
  assert not problems, "\n".join(problems)


def _elastic_problems(args: list[str]) -> list[str]:
  """What `python -m diloco_jax.elastic` would refuse before starting: its
  flags, the config as main checks it, and the elastic settings."""
  try:
    values = _parse("diloco_jax.elastic", args)
    config = values.config
    run_config = validation.validate_config(
        config, config.diloco.islands * config.mesh.data, elastic=True)
    elastic_settings.check(run_config)
  except Exception as e:  # pylint: disable=broad-except
    return [str(e).strip().splitlines()[-1]]
  return []


def test_the_command_check_sees_each_kind_of_mistake(reader_files):
  """A command broken each way the check is for is reported."""
  cases = {
      "--config=configs/default.py --workdir=gs://b/x": "is a URL",
      "--config=configs/default.py --workdir=w --config.total_steps=-3":
          "config.total_steps=-3",
      "--config=configs/default.py --workdir=w --config.no_field=1":
          "no_field",
      "--config=configs/default.py": "--workdir is required",
      "--config=configs/c4_150m.py --workdir=w --config.data.path=/data/c4":
          "tokenizer_path",
      "--config=configs/c4_150m.py --workdir=w --config.data.path=c4 "
      "--config.data.tokenizer_path=/data/c4/spm.model":
          "config.data.path='c4' does not exist",
      "--config=configs/default.py --workdir=w --num_processes=two":
          "num_processes",
  }
  for command, expected in cases.items():
    problems = _main_problems(command.split(), reader_files)
    assert any(expected in p for p in problems), (command, problems)
  assert not _main_problems(
      "--config=configs/c4_150m.py --workdir=w --config.data.path=/data/c4 "
      "--config.data.tokenizer_path=/data/c4/spm.model --num_processes=N"
      .split(), reader_files)
  assert _commands('ssh h --command="cd x && python -m diloco_jax.main '
                   '--config=c.py" && python -m experiments.all --q; '
                   'bash -c "python -m diloco_jax.launch -- --config=c.py"'
                   ) == [("diloco_jax.main", ["--config=c.py"]),
                         ("experiments.all", ["--q"]),
                         ("diloco_jax.launch", ["--", "--config=c.py"])]
  assert _experiment_problems("experiments.all", ["--scale=medium"])
  assert _experiment_problems("experiments.all", ["--studies=table2",
                                                  "--scale=large"])


# Anchors.


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: its text (links, code and emphasis
  marks dropped) lower-cased, punctuation other than - and _ removed,
  spaces made hyphens."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  text = re.sub(r"[`*]", "", text).strip().lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
  """Every heading anchor of a page; a repeated heading's get -1, -2."""
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  seen, anchors = {}, set()
  for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.M):
    slug = _slug(heading)
    anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
    seen[slug] = seen.get(slug, 0) + 1
  return anchors


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_anchor_link_names_a_heading(page):
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  problems = []
  for target, fragment in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
    linked = (page.parent / target).resolve() if target else page
    if linked.suffix != ".md" or not linked.exists():
      continue  # a file link; test_links_and_module_paths_resolve checks it
    if fragment not in _anchors(linked):
      problems.append(f"{target}#{fragment}")
  assert not problems, "anchors that name no heading:\n" + "\n".join(problems)


def test_anchors_follow_githubs_slugs():
  assert _slug("Eager updates: warm-up rounds (`eager_warmup`)") == (
      "eager-updates-warm-up-rounds-eager_warmup")
  assert _slug("Several hosts (GPU clusters, TPU slices, CPU processes)") == (
      "several-hosts-gpu-clusters-tpu-slices-cpu-processes")
  assert _slug("Table 2 at 20 tokens per parameter (**small**)") == (
      "table-2-at-20-tokens-per-parameter-small")


# Figures the pages quote from a config.


def _agrees(quoted: str, value: float) -> bool:
  """Whether a count as the pages write it (0.15M, 16.4M, 0.85B, 401)
  is `value` to the digits it gives."""
  number, unit = re.fullmatch(r"([\d.,]+)([MB]?)", quoted).groups()
  number = number.replace(",", "")
  scale = {"": 1, "M": 1e6, "B": 1e9}[unit]
  decimals = len(number.partition(".")[2])
  return abs(float(number) * scale - value) <= 0.5 * 10**-decimals * scale


def test_the_scales_the_pages_quote_are_the_configs():
  """Every mention of a configs/scaling.py scale's parameters, tokens and
  rounds agrees with the config (rounds once read 400 where the config
  runs 401)."""
  scaling = importlib.import_module("configs.scaling")
  rows = re.findall(r"^\| `(small|large|gpu)` \| (\S+) .*?\| (\S+) \| "
                    r"([\d,]+) \|", (ROOT / "docs/results.md").read_text(),
                    re.M)
  assert {row[0] for row in rows} == {"small", "large", "gpu"}
  mentions = [(scale, "rounds", rounds) for scale, _, _, rounds in rows]
  mentions += [(scale, "params", params) for scale, params, _, _ in rows]
  mentions += [(scale, "tokens", tokens) for scale, _, tokens, _ in rows]
  in_docstring = re.findall(
      r"^\s+(small|large|gpu)\s+(\S+) params,\s+(\S+) tokens(?:,\s+(\d+) "
      r"rounds)?", scaling.__doc__, re.M)
  assert len(in_docstring) == 3  # the check reads what the file says
  for scale, params, tokens, rounds in in_docstring:
    mentions += [(scale, "params", params), (scale, "tokens", tokens)]
    if rounds:
      mentions.append((scale, "rounds", rounds))
  in_readme = re.findall(
      r"`(small|large|gpu)` ([\d.]+M)(?: params)? \((\d+) rounds",
      (ROOT / "README.md").read_text())
  assert len(in_readme) == 2
  for scale, params, rounds in in_readme:
    mentions += [(scale, "params", params), (scale, "rounds", rounds)]
  wrong = []
  for scale, what, quoted in mentions:
    config = scaling.get_config(scale)
    actual = {
        "rounds": -(-config.total_steps // config.diloco.inner_steps),
        "params": scaling.parameters(config.model),
        "tokens": (config.total_steps * config.diloco.islands
                   * config.data.batch_size * config.data.sequence_length),
    }[what]
    if not _agrees(quoted, actual):
      wrong.append(f"{scale} {what}: {quoted}, the config {actual:,}")
  assert not wrong, "\n".join(wrong)


# One home per measured figure.

# Headline figures as the pages write them, each with the one page that
# holds it: the page whose table measured it (docs/results.md for the
# studies). Every other page links to that page instead of restating the
# figure, so a new measurement is one edit.
FIGURE_HOMES = {
    "+2.3%": "docs/results.md",  # eager updates after 2 warm-up rounds
    "+1.5% ± 0.5": "docs/results.md",  # DiLoCo k = 4 against DDP at 0.82M
    "54x": "docs/results.md",  # SparseLoCo 2% in 2 bits against fp32
    "-0.6% ± 0.8": "docs/results.md",  # sign pruning 25%
    "+6.5%": "docs/results.md",  # adaptive low rank in the codecs study
    "25-240 s": "docs/results.md",  # a large-scale study run on one H100
    "7.75x": "docs/compression.md",  # int4 on the default config
    "1.25x": "docs/benchmarks.md",  # the GPU inner step against torch.compile
    "40.5%": "docs/benchmarks.md",  # model FLOP utilization on one H100
    "0.74x": "docs/elastic.md",  # pipelined delayed rounds at 10 Mbit/s
    "0.83 of": "docs/elastic.md",  # compute used by time-budgeted rounds
    "-12% to +11%": "docs/shaped_links.md",  # shaped runs against the model
}
# Figures that change with every measurement, as patterns: the suite's
# test count ("1,241 tests") lives in BUILD.md only.
FIGURE_PATTERN_HOMES = {
    r"\d,\d{3} tests": "BUILD.md",
}
ALL_PAGES = sorted([*PAGES, ROOT / "CONTRIBUTING.md"])


def test_each_headline_figure_has_one_home():
  problems = []
  figures = {re.escape(figure): home for figure, home in FIGURE_HOMES.items()}
  for figure, home in {**figures, **FIGURE_PATTERN_HOMES}.items():
    # Not inside a longer number: "54x" is not in "0.54x".
    pattern = re.compile(r"(?<![\d.])" + figure)
    found = [str(page.relative_to(ROOT)) for page in ALL_PAGES
             if pattern.search(page.read_text())]
    if found != [home]:
      problems.append(f"{figure!r} is on {found or 'no page'}; its home is "
                      f"{home}: link there instead of restating it")
  assert not problems, "\n".join(problems)
