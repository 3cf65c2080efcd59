from proxy.cli import main

main(prog_name="blazar-proxy")
