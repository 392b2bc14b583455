module attention/gateway

go 1.27
