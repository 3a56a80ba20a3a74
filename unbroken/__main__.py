from unbroken.cli import main

# Guarded so that multiprocessing's spawn (used by torch DCP's async saver) can re-import this
# module in a child without re-running the command line.
if __name__ == "__main__":
    main()
