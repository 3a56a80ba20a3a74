from unbroken.cli import main

main()
