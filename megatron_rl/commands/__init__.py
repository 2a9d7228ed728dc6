"""What each `flexfloor` command does once its flags are parsed: `run(args)` of the module named after
the command. `megatron_rl/cli/` defines the flags and imports a command's module here only when that
command runs, so these modules import what they use (torch, numpy) at their top while `flexfloor
--help` stays instant."""
