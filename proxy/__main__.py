from proxy.startup.cli import main

main(prog_name="blazar-proxy")
