"""Real place names the demo corpus draws cities from (with made-up and random-letter names; see corpus.py).

A few hundred of them, from every continent, so that the names the model learns to copy have the
letter statistics of real ones in many languages. The acceptance test's held-out cities and
scripts/demo/eval_copy.py's validation cities are in neither list (the test checks the corpus).
"""

TRAIN_CITIES = [
    "Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin",
    "Amsterdam", "Brussels", "Zurich", "Geneva", "Munich", "Hamburg", "Milan", "Naples", "Barcelona",
    "Seville", "Porto", "Athens", "Istanbul", "Cairo", "Nairobi", "Lagos", "Accra", "Casablanca",
    "Tunis", "Dubai", "Doha", "Riyadh", "Tehran", "Karachi", "Delhi", "Mumbai", "Chennai", "Kolkata",
    "Dhaka", "Bangkok", "Hanoi", "Manila", "Jakarta", "Singapore", "Kuala Lumpur", "Hong Kong",
    "Shanghai", "Beijing", "Seoul", "Tokyo", "Osaka", "Kyoto", "Sydney", "Melbourne", "Perth",
    "Auckland", "Wellington", "Toronto", "Montreal", "Vancouver", "Chicago", "Boston", "New York",
    "Seattle", "Denver", "Austin", "Houston", "Miami", "Atlanta", "Phoenix", "San Diego",
    "Los Angeles", "San Francisco", "Mexico City", "Bogota", "Lima", "Santiago", "Buenos Aires",
    "Sao Paulo", "Rio de Janeiro", "Havana", "Panama City", "Quito", "Caracas", "Reykjavik",
    "Helsinki", "Stockholm", "Copenhagen", "Tallinn", "Riga", "Vilnius", "Kyiv", "Bucharest",
    "Sofia", "Belgrade", "Zagreb", "Budapest", "Krakow", "Edinburgh", "Glasgow", "Manchester",
]
# Towns and cities beyond the capitals; corpus.pick_city draws from this list as often as from TRAIN_CITIES.
MORE_PLACES = [
    # Europe
    "Aachen", "Aberdeen", "Alicante", "Avignon", "Bari", "Bath", "Bologna", "Bonn", "Bremen", "Brighton",
    "Bruges", "Cadiz", "Cambridge", "Cardiff", "Catania", "Coimbra", "Cork", "Debrecen", "Dijon", "Dortmund",
    "Dusseldorf", "Essen", "Faro", "Ghent", "Gothenburg", "Granada", "Grenoble", "Groningen", "Hanover",
    "Heidelberg", "Innsbruck", "Kiel", "Kosice", "Lausanne", "Leeds", "Leiden", "Limerick", "Liverpool", "Lodz",
    "Lucerne", "Lugano", "Luxembourg", "Maastricht", "Mainz", "Montpellier", "Murcia", "Nice", "Nuremberg",
    "Odense", "Oslo", "Oulu", "Oviedo", "Oxford", "Padua", "Palermo", "Pamplona", "Parma", "Pisa", "Plovdiv",
    "Poznan", "Rennes", "Rotterdam", "Salzburg", "Santander", "Siena", "Split", "Strasbourg", "Stuttgart",
    "Szeged", "Toulouse", "Trieste", "Trondheim", "Utrecht", "Uppsala", "Verona", "Vigo", "Wroclaw", "York",
    "Zaragoza", "Zadar", "Cluj", "Iasi", "Timisoara", "Lviv", "Kharkiv", "Dnipro", "Chisinau", "Podgorica",
    "Mostar", "Ohrid", "Thessaloniki", "Patras", "Heraklion", "Nicosia", "Limassol", "Valletta", "Bergamo",
    "Brescia", "Modena", "Ravenna", "Lecce", "Cagliari", "Salamanca", "Toledo", "Burgos", "Almeria",
    "Tarragona", "Girona", "Braga", "Evora", "Aveiro", "Funchal", "Tours", "Angers", "Caen", "Rouen", "Metz",
    "Nancy", "Reims", "Amiens", "Limoges", "Poitiers", "Perpignan", "Toulon", "Cannes", "Ajaccio", "Kassel",
    "Erfurt", "Rostock", "Potsdam", "Freiburg", "Augsburg", "Regensburg", "Wurzburg", "Ulm", "Bielefeld",
    "Aalborg", "Esbjerg", "Stavanger", "Tromso", "Lulea", "Umea", "Kiruna", "Turku", "Vaasa", "Joensuu",
    "Parnu", "Daugavpils", "Klaipeda", "Gomel", "Vitebsk", "Murmansk", "Kazan", "Samara", "Perm", "Omsk",
    "Tomsk", "Irkutsk", "Novosibirsk", "Yekaterinburg", "Sochi", "Volgograd",
    # Asia and the Middle East
    "Agra", "Ahmedabad", "Amritsar", "Bangalore", "Bhopal", "Chandigarh", "Coimbatore", "Goa", "Guwahati",
    "Hyderabad", "Indore", "Kanpur", "Kochi", "Lucknow", "Madurai", "Mysore", "Nagpur", "Patna", "Ranchi",
    "Shimla", "Udaipur", "Varanasi", "Islamabad", "Peshawar", "Quetta", "Multan", "Chittagong", "Sylhet",
    "Pokhara", "Thimphu", "Kandy", "Galle", "Mandalay", "Chiang Mai", "Phuket", "Pattaya", "Vientiane",
    "Siem Reap", "Da Nang", "Hue", "Cebu", "Davao", "Surabaya", "Bandung", "Medan", "Denpasar", "Yogyakarta",
    "Penang", "Ipoh", "Kuching", "Xiamen", "Chengdu", "Chongqing", "Wuhan", "Xian", "Nanjing", "Hangzhou",
    "Suzhou", "Guangzhou", "Shenzhen", "Harbin", "Qingdao", "Dalian", "Kunming", "Lhasa", "Urumqi", "Macau",
    "Kaohsiung", "Tainan", "Incheon", "Gwangju", "Daejeon", "Ulsan", "Jeju", "Kobe", "Yokohama", "Sendai",
    "Hiroshima", "Nara", "Kanazawa", "Naha", "Ulaanbaatar", "Bishkek", "Dushanbe", "Ashgabat", "Baku",
    "Samarkand", "Bukhara", "Astana", "Shymkent", "Isfahan", "Shiraz", "Tabriz", "Mashhad", "Basra", "Erbil",
    "Baghdad", "Mosul", "Damascus", "Aleppo", "Beirut", "Jerusalem", "Tel Aviv", "Jeddah", "Mecca", "Medina",
    "Dammam", "Manama", "Abu Dhabi", "Sharjah", "Salalah", "Sanaa", "Aden", "Antalya", "Bursa", "Konya",
    "Trabzon", "Adana",
    # Africa
    "Alexandria", "Luxor", "Aswan", "Giza", "Khartoum", "Addis Ababa", "Asmara", "Djibouti", "Mogadishu",
    "Mombasa", "Kisumu", "Kampala", "Entebbe", "Dodoma", "Arusha", "Zanzibar", "Lusaka", "Harare", "Bulawayo",
    "Maputo", "Lilongwe", "Blantyre", "Gaborone", "Windhoek", "Johannesburg", "Pretoria", "Cape Town",
    "Bloemfontein", "Maseru", "Mbabane", "Antananarivo", "Luanda", "Kinshasa", "Brazzaville", "Libreville",
    "Douala", "Yaounde", "Abuja", "Kano", "Ibadan", "Cotonou", "Lome", "Ouagadougou", "Niamey", "Bamako",
    "Conakry", "Freetown", "Monrovia", "Abidjan", "Banjul", "Nouakchott", "Rabat", "Marrakesh", "Fez",
    "Tangier", "Agadir", "Algiers", "Oran", "Tripoli", "Benghazi", "Sfax",
    # The Americas
    "Anchorage", "Albuquerque", "Baltimore", "Boise", "Buffalo", "Charlotte", "Cincinnati", "Cleveland",
    "Columbus", "El Paso", "Fresno", "Honolulu", "Indianapolis", "Jacksonville", "Kansas City", "Las Vegas",
    "Louisville", "Milwaukee", "Minneapolis", "New Orleans", "Oakland", "Oklahoma City", "Philadelphia",
    "Pittsburgh", "Raleigh", "Richmond", "Sacramento", "Salt Lake City", "San Antonio", "Savannah", "Spokane",
    "Tulsa", "Edmonton", "Saskatoon", "Victoria", "Hamilton", "Kingston", "Moncton", "Charlottetown",
    "Guadalajara", "Monterrey", "Puebla", "Tijuana", "Cancun", "Merida", "Oaxaca", "Acapulco",
    "Guatemala City", "Tegucigalpa", "Managua", "Santo Domingo", "San Juan", "Nassau",
    "Bridgetown", "Guayaquil", "Cuenca", "Arequipa", "Trujillo", "Cartagena", "Barranquilla", "Maracaibo",
    "Valparaiso", "Concepcion", "Antofagasta", "Mendoza", "Salta", "Ushuaia", "Mar del Plata", "Porto Alegre",
    "Curitiba", "Florianopolis", "Brasilia", "Manaus", "Natal", "Goiania", "Campinas", "Santos", "Sucre",
    "Cochabamba", "Santa Cruz", "Paramaribo", "Georgetown", "Cayenne",
    # Oceania
    "Canberra", "Geelong", "Townsville", "Newcastle", "Wollongong", "Launceston", "Alice Springs", "Rotorua",
    "Nelson", "Napier", "Suva", "Nadi", "Apia", "Noumea", "Papeete", "Port Moresby",
]
