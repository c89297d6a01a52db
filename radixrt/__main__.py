from radixrt.cli import main

main()
