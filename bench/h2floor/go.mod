module h2floor

go 1.24
