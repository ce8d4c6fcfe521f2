from duplex.cli import main

if __name__ == "__main__":  # vLLM spawns workers that re-import __main__
    raise SystemExit(main())
