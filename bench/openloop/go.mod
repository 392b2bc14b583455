module openloop

go 1.24
