from pointforge.cli.main import main

main()
