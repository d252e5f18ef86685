from kvcal.cli import main

main()
